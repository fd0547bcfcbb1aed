// The demo page: speaks a text in a (cloned) voice through the server and plays it as it
// streams, with the SDK the page shares with everyone else (clonecast.js) and a gapless
// AudioWorklet player (player-worklet.js). `window.__clonecast` mirrors what the page shows,
// for the browser tests.
import { ClonecastError, connect, wavFromPcm16 } from "./clonecast.js";

const $ = (id) => document.getElementById(id);
const state = {
  state: "idle",
  chunks: 0,
  bytes: 0,
  framesPlayed: 0,
  underruns: 0,
  underrunFrames: 0,
  ttfaMs: null,
  serverTtfaMs: null,
  captions: [],
  error: null,
  voiceId: null,
  recordedSeconds: 0,
  timeline: [], // per chunk: {at: s since speak, audio: s of audio up to its end, late}
};
window.__clonecast = state;

let client = null;
let utterance = null;
let audio = null; // {context, node}
let received = []; // this utterance's PCM16 chunks, for the download
let recording = null; // {context, stream, node, parts, rate} while the microphone records
let recorded = null; // the last recording, as WAV bytes

function show(updates) {
  Object.assign(state, updates);
  $("state").textContent = state.state;
  $("chunks").textContent = String(state.chunks);
  $("underruns").textContent = String(state.underruns);
  $("ttfa-client").textContent = state.ttfaMs === null ? "-" : `${state.ttfaMs.toFixed(0)} ms`;
  $("ttfa-server").textContent = state.serverTtfaMs === null ? "-" : `${state.serverTtfaMs} ms`;
}

function showError(error) {
  const code = error instanceof ClonecastError ? error.code : "client_error";
  const words = error instanceof ClonecastError ? error.detail : String(error.message || error);
  state.error = { code, message: words };
  $("error").hidden = false;
  $("error").textContent = `${words} (${code})`;
}

async function ensureClient() {
  if (client && !client.closedError) return client;
  const scheme = location.protocol === "https:" ? "wss:" : "ws:";
  const token = new URLSearchParams(location.search).get("token");
  client = await connect({ url: `${scheme}//${location.host}/v1/stream`, token });
  client.addEventListener("close", () => { client = null; });
  const untrained = $("untrained");
  untrained.hidden = !client.modelUntrained;
  untrained.textContent = client.ready.model?.notice ?? "";
  return client;
}

function outputRate() {
  return Number($("output-rate").value);
}

// The playback context runs at the output rate asked of the server (24 kHz: the model's own,
// no resampling anywhere), so the page plays exactly the samples the server sent.
async function ensureAudio() {
  const rate = outputRate();
  if (audio && audio.rate === rate) return audio;
  if (audio) await audio.context.close();
  audio = null;
  const context = new AudioContext({ sampleRate: rate });
  await context.audioWorklet.addModule("player-worklet.js");
  const node = new AudioWorkletNode(context, "clonecast-player", { outputChannelCount: [1] });
  node.port.onmessage = (event) => show({
    framesPlayed: event.data.framesPlayed,
    underruns: event.data.underruns,
    underrunFrames: event.data.underrunFrames,
  });
  node.connect(context.destination);
  audio = { context, node, rate };
  return audio;
}

function params() {
  const out = {};
  const number = (id) => ($(id).value === "" ? null : Number($(id).value));
  if (number("temperature") !== null) out.temperature = number("temperature");
  if (number("top-k") !== null) out.top_k = number("top-k");
  if (number("top-p") !== null) out.top_p = number("top-p");
  if (number("seed") !== null) out.seed = number("seed");
  if (number("max-duration") !== null) out.max_duration_s = number("max-duration");
  return out;
}

async function speak(event) {
  event.preventDefault();
  if (typing) return; // in type-and-hear mode Enter flushes instead (onKey)
  await run((c, opts) => c.speak($("text").value, opts));
}

// One utterance from start to end: the voice, then its audio played as it streams.
// `open(client, opts)` makes the utterance (a speak, or a stream fed as the user types).
async function run(open) {
  $("error").hidden = true;
  state.error = null;
  try {
    const [c, player] = await Promise.all([ensureClient(), ensureAudio()]);
    await player.context.resume();
    const opts = { params: params(), output: { format: "pcm16", sampleRate: outputRate() } };
    const reference = await referenceAudio();
    if (reference) {
      show({ state: "encoding the voice" });
      const voice = await c.createVoice(reference.audio, reference.transcript);
      opts.voiceId = voice.voice_id;
      show({ voiceId: voice.voice_id });
    }
    player.node.port.postMessage({ type: "reset" });
    received = [];
    show({ state: "speaking", chunks: 0, bytes: 0, ttfaMs: null, serverTtfaMs: null, captions: [], timeline: [] });
    $("caption").textContent = "";
    $("stop").disabled = false;
    $("speak").disabled = true;
    $("download").disabled = true;
    const sent = performance.now();
    utterance = open(c, opts);
    utterance.addEventListener("segment", (e) => {
      state.captions.push(e.segment.text);
      $("caption").textContent = e.segment.text;
    });
    for await (const chunk of utterance) {
      if (state.ttfaMs === null) show({ ttfaMs: performance.now() - sent });
      const size = chunk.data.byteLength; // (the buffer is transferred to the player below)
      received.push(chunk.data.slice(0));
      track((performance.now() - sent) / 1000, size / 2 / player.rate);
      player.node.port.postMessage({ type: "pcm", pcm: chunk.data }, [chunk.data]);
      show({ chunks: state.chunks + 1, bytes: state.bytes + size });
    }
    player.node.port.postMessage({ type: "end" });
    drawWaveform();
    const done = await utterance.wait();
    if (done.type === "done") {
      $("rtf").textContent = done.stats.rtf === null ? "-" : done.stats.rtf.toFixed(3);
      show({ state: "done", serverTtfaMs: done.stats.first_audio_ms });
    } else {
      show({ state: "cancelled" });
    }
  } catch (error) {
    show({ state: "failed" });
    showError(error);
  } finally {
    $("stop").disabled = true;
    $("speak").disabled = false;
    $("download").disabled = received.length === 0;
    typing = null;
  }
}

// -- type and hear: each sentence speaks as soon as it is typed, Enter ends -----------------

let typing = null; // {sent: the text already appended, ready: a promise of the utterance}

function onType() {
  if (!$("type-and-hear").checked) return;
  const text = $("text").value;
  if (!typing) {
    let ready;
    const started = new Promise((resolve) => { ready = resolve; });
    typing = { sent: "", started };
    run((c, opts) => {
      const utt = c.stream(opts);
      ready(utt);
      return utt;
    });
  }
  const session = typing;
  session.started.then((utt) => {
    if (typing !== session || !text.startsWith(session.sent)) return; // edits before: kept
    const more = text.slice(session.sent.length);
    if (more) {
      session.sent = text;
      utt.append(more);
    }
  });
}

function onKey(event) {
  if (!typing || event.key !== "Enter" || event.shiftKey) return;
  event.preventDefault();
  onType(); // what was typed last
  const session = typing;
  session.started.then((utt) => {
    if (session.sent) utt.flush().catch(showError);
    else utt.cancel();
  });
}

async function stop() {
  if (!utterance) return;
  audio?.node.port.postMessage({ type: "stop" }); // fades out within 5 ms
  await utterance.cancel();
  show({ state: "cancelled" });
}

function download() {
  const total = received.reduce((n, b) => n + b.byteLength, 0);
  const pcm = new Uint8Array(total);
  let at = 0;
  for (const part of received) {
    pcm.set(new Uint8Array(part), at);
    at += part.byteLength;
  }
  const wav = wavFromPcm16(pcm, audio?.rate ?? 24000);
  const url = URL.createObjectURL(new Blob([wav], { type: "audio/wav" }));
  const link = Object.assign(document.createElement("a"), { href: url, download: "clonecast.wav" });
  link.click();
  setTimeout(() => URL.revokeObjectURL(url), 1000);
}

// -- the reference voice ---------------------------------------------------------------------

async function referenceAudio() {
  const source = $("voice-source").value;
  const transcript = $("transcript").value || null;
  if (source === "sample") {
    const [audio, text] = await Promise.all([
      fetch("samples/voice.wav").then((r) => r.arrayBuffer()),
      fetch("samples/voice.txt").then((r) => r.text()),
    ]);
    return { audio, transcript: text.trim() };
  }
  if (source === "file") {
    const file = $("voice-file").files[0];
    if (!file) throw new Error("choose a recording first");
    return { audio: await file.arrayBuffer(), transcript };
  }
  if (source === "mic") {
    if (!recorded) throw new Error("record your voice first (a few seconds)");
    return { audio: recorded, transcript };
  }
  return null;
}

function showVoiceFields() {
  const source = $("voice-source").value;
  $("file-fields").hidden = source !== "file";
  $("mic-fields").hidden = source !== "mic";
  $("transcript-fields").hidden = source === "default" || source === "sample";
}

async function toggleRecording() {
  if (recording) {
    recording.node.port.postMessage("flush");
    await new Promise((resolve) => setTimeout(resolve, 150)); // the last block arrives
    recording.stream.getTracks().forEach((t) => t.stop());
    await recording.context.close();
    const { parts, rate } = recording;
    recording = null;
    const samples = new Float32Array(parts.reduce((n, p) => n + p.length, 0));
    let at = 0;
    for (const part of parts) {
      samples.set(part, at);
      at += part.length;
    }
    const pcm = new Int16Array(samples.length);
    for (let i = 0; i < samples.length; i += 1) {
      pcm[i] = Math.max(-32768, Math.min(32767, Math.round(samples[i] * 32767)));
    }
    recorded = wavFromPcm16(new Uint8Array(pcm.buffer), rate);
    show({ recordedSeconds: samples.length / rate });
    $("record").textContent = "Record again";
    $("record").setAttribute("aria-pressed", "false");
    $("recorded").textContent = `${state.recordedSeconds.toFixed(1)} s recorded`;
    return;
  }
  try {
    const stream = await navigator.mediaDevices.getUserMedia({ audio: true });
    const context = new AudioContext(); // the microphone's own rate
    await context.audioWorklet.addModule("recorder-worklet.js");
    const node = new AudioWorkletNode(context, "clonecast-recorder");
    const parts = [];
    node.port.onmessage = (event) => parts.push(event.data);
    context.createMediaStreamSource(stream).connect(node);
    recording = { context, stream, node, parts, rate: context.sampleRate };
    $("record").textContent = "Stop recording";
    $("record").setAttribute("aria-pressed", "true");
    $("recorded").textContent = "recording...";
  } catch (error) {
    showError(error);
  }
}

// -- what the listener gets: arrivals against the playhead, the waveform -------------------

function track(at, seconds) {
  const first = state.timeline[0];
  const before = state.timeline.length ? state.timeline.at(-1).audio : 0;
  // the playhead starts with the first chunk: chunk k is late if it arrives after the audio
  // before it has played
  const late = first !== undefined && at > first.at + before;
  state.timeline.push({ at, audio: before + seconds, late });
  drawTimeline();
}

function color(name) {
  return getComputedStyle(document.documentElement).getPropertyValue(name).trim() || "#888";
}

function drawTimeline() {
  const canvas = $("timeline");
  const g = canvas.getContext("2d");
  const points = state.timeline;
  g.clearRect(0, 0, canvas.width, canvas.height);
  if (!points.length) return;
  const span = Math.max(points.at(-1).at, points.at(-1).audio + points[0].at) * 1.05;
  const x = (s) => (s / span) * canvas.width;
  const y = (s) => canvas.height - (s / span) * canvas.height;
  g.strokeStyle = color("--muted");
  g.beginPath(); // the playhead: audio played since the first chunk
  g.moveTo(x(points[0].at), y(0));
  g.lineTo(x(points[0].at + points.at(-1).audio), y(points.at(-1).audio));
  g.stroke();
  g.lineWidth = 2;
  let level = 0;
  for (const p of points) {
    g.strokeStyle = p.late ? color("--error") : color("--accent");
    g.beginPath(); // a step: this chunk's audio became available at its arrival
    g.moveTo(x(p.at), y(level));
    g.lineTo(x(p.at), y(p.audio));
    g.stroke();
    level = p.audio;
  }
  g.lineWidth = 1;
}

function drawWaveform() {
  const canvas = $("waveform");
  const g = canvas.getContext("2d");
  g.clearRect(0, 0, canvas.width, canvas.height);
  const total = received.reduce((n, b) => n + b.byteLength / 2, 0);
  if (!total) return;
  const perColumn = Math.max(1, Math.floor(total / canvas.width));
  g.fillStyle = color("--accent");
  let column = 0;
  let low = 0;
  let high = 0;
  let count = 0;
  for (const part of received) {
    for (const sample of new Int16Array(part)) {
      low = Math.min(low, sample);
      high = Math.max(high, sample);
      count += 1;
      if (count === perColumn) {
        const mid = canvas.height / 2;
        g.fillRect(column, mid - (high / 32768) * mid, 1, Math.max(1, ((high - low) / 32768) * mid));
        column += 1;
        low = high = count = 0;
      }
    }
  }
}

$("insecure").hidden = window.isSecureContext;
$("speak-form").addEventListener("submit", speak);
$("stop").addEventListener("click", stop);
$("download").addEventListener("click", download);
$("voice-source").addEventListener("change", showVoiceFields);
$("text").addEventListener("input", onType);
$("text").addEventListener("keydown", onKey);
$("record").addEventListener("click", toggleRecording);
showVoiceFields();
ensureClient().catch(showError); // shows the untrained-model banner before the first speak
show({});
