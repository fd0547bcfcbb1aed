// clonecast client for browsers and Node >= 20: one ES module, no dependencies.
// It speaks the WebSocket protocol clonecast.v1 (docs/protocol.md): a Client per connection,
// an Utterance per speak/stream that is both an async iterator of audio chunks and an
// EventTarget ("started", "segment", "audio", "done", "cancelled", "error"). When the socket
// closes every pending utterance, voice and ping fails with a ClonecastError: nothing is
// replayed or silently reconnected (audio would be lost or repeated).

export const PROTOCOL = "clonecast.v1";
export const DEFAULT_URL = "ws://127.0.0.1:8737/v1/stream";

// Close codes of the protocol, named like the errors the server sends before them.
const CLOSE_CODES = {
  1008: "rate_limited",
  1009: "message_too_large",
  1011: "server_error",
  1012: "server_restarting",
  4401: "unauthorized",
  4403: "forbidden_origin",
  4408: "idle_timeout",
  4429: "over_capacity",
};
// Worth retrying later (the same request may succeed): capacity, transient failures.
const RETRYABLE = new Set([
  "over_capacity", "rate_limited", "slow_consumer", "generation_failed", "internal",
  "server_error", "server_restarting", "idle_timeout", "connection_closed", "connection_failed", "timeout",
  "not_ready", "draining", // loading or restarting its engine / shutting down: retry, reconnect
]);

export class ClonecastError extends Error {
  /** An `error` from the server (`code` as in docs/protocol.md) or a connection failure. */
  constructor(code, message, { id = null, requestId = null } = {}) {
    super(`${code}: ${message}`);
    this.name = "ClonecastError";
    this.code = code;
    this.detail = message;
    this.id = id;
    this.requestId = requestId;
    this.retryable = RETRYABLE.has(code);
  }
}

/** Opens a connection and waits for the server's `ready`. */
export async function connect({
  url = DEFAULT_URL,
  apiKey = null,
  token = null,
  WebSocket: Socket = globalThis.WebSocket,
  timeoutMs = 30000,
} = {}) {
  if (typeof Socket !== "function") {
    throw new ClonecastError(
      "connection_failed",
      "no WebSocket constructor: pass one (e.g. the `ws` package's) or run Node with " +
        "--experimental-websocket",
    );
  }
  const target = new URL(url);
  if (token) target.searchParams.set("token", token); // short-lived browser tokens
  const protocols = [PROTOCOL];
  if (apiKey) protocols.push(`bearer.${apiKey}`); // never in the URL (it reaches logs)
  const ws = new Socket(target.toString(), protocols);
  ws.binaryType = "arraybuffer";
  const ready = await new Promise((resolve, reject) => {
    const timer = setTimeout(() => {
      fail(new ClonecastError("timeout", `no ready message within ${timeoutMs} ms`));
      ws.close();
    }, timeoutMs);
    const errors = [];
    function fail(error) {
      clearTimeout(timer);
      ws.removeEventListener("message", onMessage);
      reject(error);
    }
    function onMessage(event) {
      if (typeof event.data !== "string") return;
      const message = JSON.parse(event.data);
      if (message.type === "error") {
        errors.push(message);
        return; // the close that follows says what it was
      }
      if (message.type === "ready") {
        clearTimeout(timer);
        ws.removeEventListener("message", onMessage);
        ws.removeEventListener("close", onClose);
        resolve(message);
      }
    }
    function onClose(event) {
      const said = errors.at(-1);
      const code = CLOSE_CODES[event.code] || "connection_failed";
      fail(new ClonecastError(said ? said.code : code, said ? said.message : `closed (${event.code})`));
    }
    ws.addEventListener("message", onMessage);
    ws.addEventListener("close", onClose);
  });
  return new Client(ws, ready);
}

let counter = 0;
function nextId(prefix) {
  counter += 1;
  return `${prefix}-${Date.now().toString(36)}-${counter}`;
}

export class Client extends EventTarget {
  constructor(ws, ready) {
    super();
    this.ready = ready;
    this.sessionId = ready.session_id;
    this.sampleRate = ready.audio?.sample_rate ?? 24000;
    this.modelUntrained = Boolean(ready.model?.untrained);
    this.limits = ready.limits ?? {};
    this.closedError = null;
    this._ws = ws;
    this._utterances = new Map();
    this._voices = new Map(); // request_id -> {resolve, reject}
    this._pings = [];
    this._meta = new Map(); // `${id}/${seq}` -> its audio message
    ws.addEventListener("message", (event) => this._onMessage(event.data));
    ws.addEventListener("close", (event) => this._onClose(event));
  }

  /** Registers a voice from a recording's bytes (WAV, FLAC, OGG, MP3...): its description. */
  createVoice(audio, transcript = null) {
    const bytes = toBytes(audio);
    const requestId = nextId("voice");
    const message = { type: "voice.upload", bytes: bytes.byteLength, request_id: requestId };
    if (transcript) message.transcript = transcript;
    return new Promise((resolve, reject) => {
      this._live(reject);
      this._voices.set(requestId, { resolve, reject });
      this._send(message);
      this._ws.send(bytes);
    });
  }

  /** Speaks a whole text. `opts`: id, voiceId, voice {audio, transcript}, params, output
   * {format, sampleRate}, timeoutMs (no message for this long: the utterance fails). */
  speak(text, opts = {}) {
    const utt = this._open(opts, false);
    this._send({ type: "speak", id: utt.id, text, ...utt._opening });
    return utt;
  }

  /** An utterance fed by `append(text)` and ended by `flush()` (text as it is typed). */
  stream(opts = {}) {
    return this._open(opts, true);
  }

  ping() {
    return new Promise((resolve, reject) => {
      this._live(reject);
      const requestId = nextId("p"); // its pong, or its refusal, carries it
      this._pings.push({ requestId, resolve, reject });
      this._send({ type: "ping", request_id: requestId });
    });
  }

  _takePing(requestId) {
    const at = this._pings.findIndex((p) => p.requestId === requestId);
    return at < 0 ? null : this._pings.splice(at, 1)[0];
  }

  close() {
    this._closing = true;
    this._ws.close(1000);
  }

  _open(opts, streaming) {
    if (this.closedError) throw this.closedError;
    const id = opts.id ?? nextId("u");
    if (this._utterances.has(id)) throw new ClonecastError("duplicate_id", `${id} is running`);
    const opening = {};
    if (opts.voiceId) opening.voice_id = opts.voiceId;
    if (opts.voice) {
      opening.voice = { audio_b64: toBase64(toBytes(opts.voice.audio)) };
      if (opts.voice.transcript) opening.voice.transcript = opts.voice.transcript;
    }
    if (opts.params) opening.params = { ...opts.params };
    if (opts.output) {
      const { format, sampleRate } = opts.output;
      opening.output = {};
      if (format) opening.output.format = format;
      if (sampleRate) opening.output.sample_rate = sampleRate;
    }
    const utt = new Utterance(this, id, opening, streaming, opts.timeoutMs ?? 0);
    this._utterances.set(id, utt);
    return utt;
  }

  _live(reject) {
    if (this.closedError) {
      reject(this.closedError);
      throw this.closedError;
    }
  }

  _send(message) {
    if (this.closedError) throw this.closedError;
    this._ws.send(JSON.stringify(message));
  }

  _onMessage(data) {
    if (typeof data !== "string") {
      this._onFrame(data);
      return;
    }
    const message = JSON.parse(data);
    const utt = this._utterances.get(message.id);
    switch (message.type) {
      case "error":
        this._onError(message);
        return;
      case "voice.created": {
        const waiter = this._voices.get(message.request_id);
        this._voices.delete(message.request_id);
        waiter?.resolve(message);
        return;
      }
      case "pong":
        // a server that does not echo request_id answers in order
        (message.request_id === undefined ? this._pings.shift() : this._takePing(message.request_id))
          ?.resolve(message);
        return;
      case "audio":
        this._meta.set(`${message.id}/${message.seq}`, message);
        return;
      default:
        utt?._onMessage(message);
    }
  }

  _onFrame(buffer) {
    const frame = unpackAudio(buffer);
    const key = `${frame.id}/${frame.seq}`;
    const meta = this._meta.get(key) ?? {};
    this._meta.delete(key);
    this._utterances.get(frame.id)?._onChunk({
      seq: frame.seq,
      last: frame.last,
      data: frame.payload,
      startMs: meta.start_ms ?? null,
      endMs: meta.end_ms ?? null,
      format: meta.format,
      sampleRate: meta.sample_rate,
    });
  }

  _onError(message) {
    const error = new ClonecastError(message.code, message.message, {
      id: message.id ?? null,
      requestId: message.request_id ?? null,
    });
    const utt = this._utterances.get(message.id);
    const waiter = this._voices.get(message.request_id);
    const ping = utt || waiter ? null : this._takePing(message.request_id);
    if (utt) {
      utt._onError(error);
    } else if (waiter) {
      this._voices.delete(message.request_id);
      waiter.reject(error);
    } else if (ping) {
      ping.reject(error); // refused (rate_limited): the connection goes on
    } else {
      // not about a running utterance or voice: for whoever listens to the client
      this.dispatchEvent(Object.assign(new Event("error"), { error }));
    }
  }

  _onClose(event) {
    const name = this._closing ? "closed" : CLOSE_CODES[event.code] ?? "connection_closed";
    const error = new ClonecastError(name, event.reason || `the connection closed (${event.code})`);
    this.closedError = error;
    for (const utt of this._utterances.values()) utt._fail(error);
    this._utterances.clear();
    for (const waiter of [...this._voices.values(), ...this._pings]) waiter.reject(error);
    this._voices.clear();
    this._pings = [];
    this.dispatchEvent(Object.assign(new Event("close"), { error }));
  }
}

export class Utterance extends EventTarget {
  constructor(client, id, opening, streaming, timeoutMs) {
    super();
    this.id = id;
    this.started = null;
    this.segments = []; // {index, text, start_ms}: the sentence heard is the last one begun
    this.done = null;
    this.error = null;
    this._client = client;
    this._opening = opening;
    this._streaming = streaming;
    this._sent = !streaming;
    this._flushed = null;
    this._chunks = [];
    this._readers = [];
    this._over = false;
    this._timeoutMs = timeoutMs;
    this._timer = null;
    this._finished = new Promise((resolve, reject) => {
      this._resolve = resolve;
      this._reject = reject;
    });
    this._finished.catch(() => {}); // surfaced by wait(), iteration and the "error" event
    this._armTimer();
  }

  /** Adds text to a stream() utterance; complete sentences start speaking at once. */
  append(text) {
    if (!this._streaming) throw new TypeError("append() is for stream() utterances");
    if (this._flushed) throw new ClonecastError("unknown_id", `${this.id} was flushed`);
    if (this._over) throw this.error ?? new ClonecastError("unknown_id", `${this.id} is over`);
    const message = { type: "append", id: this.id, text };
    if (!this._sent) Object.assign(message, this._opening);
    this._sent = true;
    this._client._send(message);
  }

  /** Speaks what remains of the appended text; resolves on the server's `flushed`. */
  flush() {
    if (!this._streaming || !this._sent) {
      return Promise.reject(new TypeError("flush() needs a stream() utterance with text"));
    }
    if (!this._flushed) {
      this._flushed = new Promise((resolve, reject) => {
        this._flushAck = { resolve, reject };
      });
      this._flushed.catch(() => {});
      this._client._send({ type: "flush", id: this.id });
    }
    return this._flushed;
  }

  /** Barge-in: stops now; resolves once the server acknowledges (or it had finished). */
  async cancel() {
    if (this._over) return;
    this._cancelled = true;
    this._drain();
    if (!this._sent) {
      this._end("cancelled", { type: "cancelled", id: this.id });
      return;
    }
    this._client._send({ type: "cancel", id: this.id });
    await this._finished.catch(() => {});
  }

  /** The `done` message (stats included), or the ClonecastError that ended it. */
  wait() {
    return this._finished;
  }

  /** All remaining audio, joined (in the utterance's output format). */
  async collect() {
    const parts = [];
    for await (const chunk of this) parts.push(new Uint8Array(chunk.data));
    const out = new Uint8Array(parts.reduce((n, p) => n + p.byteLength, 0));
    let at = 0;
    for (const part of parts) {
      out.set(part, at);
      at += part.byteLength;
    }
    return out;
  }

  [Symbol.asyncIterator]() {
    return {
      next: () => {
        if (this._chunks.length) return Promise.resolve({ value: this._chunks.shift(), done: false });
        if (this._over || this._cancelled) {
          return this.error && !this._cancelled ? Promise.reject(this.error) : Promise.resolve({ done: true });
        }
        return new Promise((resolve, reject) => this._readers.push({ resolve, reject }));
      },
      return: () => Promise.resolve({ done: true }),
    };
  }

  _onChunk(chunk) {
    if (this._over || this._cancelled) return;
    this._armTimer();
    this.dispatchEvent(Object.assign(new Event("audio"), { chunk }));
    const reader = this._readers.shift();
    if (reader) reader.resolve({ value: chunk, done: false });
    else this._chunks.push(chunk);
  }

  _onMessage(message) {
    this._armTimer();
    switch (message.type) {
      case "started":
        this.started = message;
        this.dispatchEvent(Object.assign(new Event("started"), { message }));
        return;
      case "segment":
        this.segments.push({ index: message.index, text: message.text, start_ms: message.start_ms });
        this.dispatchEvent(Object.assign(new Event("segment"), { segment: message }));
        return;
      case "flushed":
        this._flushAck?.resolve();
        return;
      case "done":
        this.done = message;
        this._end("done", message);
        return;
      case "cancelled":
        this._end("cancelled", message);
        return;
      default:
    }
  }

  _onError(error) {
    if (this._cancelled && error.code === "unknown_id") {
      this._end("cancelled", { type: "cancelled", id: this.id }); // it finished as we cancelled
      return;
    }
    this._fail(error);
  }

  _fail(error) {
    if (this._over) return;
    this.error = error;
    this._over = true;
    this._client._utterances.delete(this.id);
    clearTimeout(this._timer);
    this._flushAck?.reject(error);
    this.dispatchEvent(Object.assign(new Event("error"), { error }));
    for (const reader of this._readers.splice(0)) {
      if (this._cancelled) reader.resolve({ done: true });
      else reader.reject(error);
    }
    this._reject(error);
  }

  _end(kind, message) {
    if (this._over) return;
    this._over = true;
    this._client._utterances.delete(this.id);
    clearTimeout(this._timer);
    this._flushAck?.resolve();
    this.dispatchEvent(Object.assign(new Event(kind), { message }));
    for (const reader of this._readers.splice(0)) reader.resolve({ done: true });
    this._resolve(message);
  }

  _drain() {
    this._chunks = [];
    for (const reader of this._readers.splice(0)) reader.resolve({ done: true });
  }

  _armTimer() {
    if (!this._timeoutMs) return;
    clearTimeout(this._timer);
    this._timer = setTimeout(() => {
      const error = new ClonecastError("timeout", `nothing for ${this.id} in ${this._timeoutMs} ms`);
      if (this._sent) this._client._send({ type: "cancel", id: this.id });
      this._fail(error);
    }, this._timeoutMs);
  }
}

/** The binary audio frame: "CC", version 1, flags (1: last), seq u32 LE, id length, id,
 * payload. Returns {id, seq, last, payload: ArrayBuffer}. */
export function unpackAudio(buffer) {
  const view = new DataView(buffer);
  if (buffer.byteLength < 9 || view.getUint8(0) !== 0x43 || view.getUint8(1) !== 0x43) {
    throw new ClonecastError("protocol_error", "not a clonecast.v1 audio frame");
  }
  if (view.getUint8(2) !== 1) throw new ClonecastError("protocol_error", "unknown frame version");
  const last = (view.getUint8(3) & 1) === 1;
  const seq = view.getUint32(4, true);
  const n = view.getUint8(8);
  const id = new TextDecoder().decode(new Uint8Array(buffer, 9, n));
  return { id, seq, last, payload: buffer.slice(9 + n) };
}

/** PCM16 little-endian bytes -> a WAV file (mono), e.g. to download an utterance. */
export function wavFromPcm16(pcm, sampleRate = 24000) {
  const data = toBytes(pcm);
  const out = new Uint8Array(44 + data.byteLength);
  const view = new DataView(out.buffer);
  const text = (at, s) => [...s].forEach((c, i) => view.setUint8(at + i, c.charCodeAt(0)));
  text(0, "RIFF");
  view.setUint32(4, 36 + data.byteLength, true);
  text(8, "WAVE");
  text(12, "fmt ");
  view.setUint32(16, 16, true);
  view.setUint16(20, 1, true);
  view.setUint16(22, 1, true);
  view.setUint32(24, sampleRate, true);
  view.setUint32(28, sampleRate * 2, true);
  view.setUint16(32, 2, true);
  view.setUint16(34, 16, true);
  text(36, "data");
  view.setUint32(40, data.byteLength, true);
  out.set(data, 44);
  return out;
}

function toBytes(audio) {
  if (audio instanceof Uint8Array) return audio;
  if (audio instanceof ArrayBuffer) return new Uint8Array(audio);
  if (ArrayBuffer.isView(audio)) return new Uint8Array(audio.buffer, audio.byteOffset, audio.byteLength);
  throw new TypeError("audio must be an ArrayBuffer or a typed array");
}

function toBase64(bytes) {
  let binary = "";
  for (let i = 0; i < bytes.length; i += 0x8000) {
    binary += String.fromCharCode(...bytes.subarray(i, i + 0x8000));
  }
  return btoa(binary);
}
