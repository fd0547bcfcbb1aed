// The JavaScript SDK against a real clonecast server (started by tests/web/test_js_sdk.py,
// which passes its address in CLONECAST_URL, a server with API keys in CLONECAST_AUTH_URL and
// their key in CLONECAST_KEY, and a reference recording in CLONECAST_REFERENCE).
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { test } from "node:test";
import WebSocketFromPackage from "ws";

import { ClonecastError, connect, unpackAudio, wavFromPcm16 } from "../clonecast.js";

const URL_ = process.env.CLONECAST_URL;
const AUTH_URL = process.env.CLONECAST_AUTH_URL;
const KEY = process.env.CLONECAST_KEY;
const REFERENCE = readFileSync(process.env.CLONECAST_REFERENCE);
const FIRST_BYTES = 15360; // 320 ms of 24 kHz PCM16
const frames = (seconds) => Math.ceil(seconds * 25);

async function withClient(fn, opts = {}) {
  const client = await connect({ url: URL_, ...opts });
  try {
    return await fn(client);
  } finally {
    client.close();
  }
}

test("speak streams chunks in order, first 320 ms, and ends with done stats", async () => {
  await withClient(async (client) => {
    assert.equal(client.sampleRate, 24000);
    assert.equal(client.modelUntrained, true);
    const utt = client.speak("Hello from JavaScript.", { params: { seed: 3, max_duration_s: 2 } });
    const events = [];
    utt.addEventListener("audio", (e) => events.push(e.chunk.seq));
    const chunks = [];
    for await (const chunk of utt) chunks.push(chunk);
    const done = await utt.wait();
    assert.equal(done.type, "done");
    assert.equal(done.reason, "length");
    assert.equal(chunks[0].data.byteLength, FIRST_BYTES);
    assert.deepEqual(chunks.map((c) => c.seq), [...chunks.keys()]);
    assert.deepEqual(events, chunks.map((c) => c.seq));
    assert.equal(chunks.at(-1).last, true);
    const total = chunks.reduce((n, c) => n + c.data.byteLength, 0);
    assert.equal(total, frames(2) * 1920);
    assert.equal(done.stats.bytes, total);
    assert.ok(done.stats.first_audio_ms > 0);
    const pcm = new Int16Array(await utt.collect().then(() => chunks[0].data));
    assert.ok(pcm.some((s) => s !== 0), "the first chunk is not silence");
  });
});

test("a cloned voice: created once, spoken by id, and inline; the same seed, the same audio", async () => {
  await withClient(async (client) => {
    const voice = await client.createVoice(REFERENCE, "A steady tone.");
    assert.match(voice.voice_id, /^v_/);
    assert.equal(voice.duration_s, 2);
    const params = { seed: 5, max_duration_s: 1 };
    const byId = await client.speak("Cloned words.", { voiceId: voice.voice_id, params }).collect();
    const inline = await client
      .speak("Cloned words.", { voice: { audio: REFERENCE, transcript: "A steady tone." }, params })
      .collect();
    const plain = await client.speak("Cloned words.", { params }).collect();
    assert.equal(byId.byteLength, frames(1) * 1920);
    assert.deepEqual(inline, byId);
    assert.notDeepEqual(plain, byId); // the voice is heard
  });
});

test("concurrent utterances on one socket each get their own audio", async () => {
  await withClient(async (client) => {
    const lengths = [0.8, 1.6, 1.2];
    const utts = lengths.map((s, i) => client.speak(`Voice ${i}.`, { params: { seed: 10 + i, max_duration_s: s } }));
    const audio = await Promise.all(utts.map((u) => u.collect()));
    assert.deepEqual(audio.map((a) => a.byteLength), lengths.map((s) => frames(s) * 1920));
    assert.ok(utts.every((u) => u.done?.type === "done"));
  });
});

test("cancel stops the audio at once and is acknowledged", async () => {
  await withClient(async (client) => {
    const utt = client.speak("A much longer utterance to cut short.", { params: { seed: 2, max_duration_s: 20 } });
    let cancelled = false;
    utt.addEventListener("cancelled", () => { cancelled = true; });
    let after = 0;
    for await (const chunk of utt) {
      assert.equal(chunk.seq, 0);
      await utt.cancel();
      utt.addEventListener("audio", () => { after += 1; });
    }
    assert.equal(cancelled, true);
    assert.equal(utt.done, null);
    await client.ping(); // the connection works and nothing more came for it
    assert.equal(after, 0);
  });
});

test("append and flush: sentences speak as they complete, with their captions", async () => {
  await withClient(async (client) => {
    const utt = client.stream({ params: { seed: 4, max_duration_s: 1 } });
    const captions = [];
    utt.addEventListener("segment", (e) => captions.push(e.segment.text));
    utt.append("The first sentence. ");
    utt.append("And the second one");
    await utt.flush();
    const audio = await utt.collect();
    assert.equal(audio.byteLength, 2 * frames(1) * 1920);
    assert.equal(utt.done.stats.segments, 2);
    assert.deepEqual(captions, ["The first sentence.", "And the second one"]);
    assert.deepEqual(utt.segments.map((s) => s.start_ms), [0, frames(1) * 40]);
  });
});

test("the server's errors reject with their code and say whether to retry", async () => {
  await withClient(async (client) => {
    const cases = [
      [client.speak("Who?", { voiceId: "v_nobody" }), "unknown_voice"],
      [client.speak("Hot.", { params: { temperature: -1 } }), "bad_parameter"],
      [client.speak("   "), "empty_text"],
      [client.speak("x".repeat(6000)), "text_too_long"],
    ];
    for (const [utt, code] of cases) {
      const error = await utt.wait().then(() => null, (e) => e);
      assert.ok(error instanceof ClonecastError, `${code}: ${error}`);
      assert.equal(error.code, code);
      assert.equal(error.retryable, false);
      assert.equal(error.id, utt.id);
      await assert.rejects(async () => { for await (const _ of utt); }, (e) => e.code === code);
    }
    const bad = await client.createVoice(new TextEncoder().encode("not audio at all")).catch((e) => e);
    assert.ok(bad instanceof ClonecastError && bad.code.startsWith("audio_"), String(bad));
    await client.ping();
  });
});

test("a lost socket rejects every pending utterance, voice and ping (nothing replayed)", async () => {
  const client = await connect({ url: URL_, WebSocket: WebSocketFromPackage });
  const utt = client.speak("Interrupted.", { params: { seed: 7, max_duration_s: 30 } });
  const ping = client.ping();
  let closed = null;
  client.addEventListener("close", (e) => { closed = e.error; });
  for await (const chunk of utt) {
    assert.equal(chunk.seq, 0);
    client._ws.terminate(); // the network goes away: no close handshake
    break;
  }
  const error = await utt.wait().then(() => null, (e) => e);
  assert.equal(error.code, "connection_closed");
  assert.equal(error.retryable, true);
  await ping.catch(() => {});
  assert.equal(closed?.code, "connection_closed");
  assert.throws(() => client.speak("Again?"), (e) => e.code === "connection_closed");
});

test("API keys: a wrong one is refused as unauthorized, the right one connects", async () => {
  const refused = await connect({ url: AUTH_URL, apiKey: "wrong" }).catch((e) => e);
  assert.ok(refused instanceof ClonecastError);
  assert.equal(refused.code, "unauthorized");
  const client = await connect({ url: AUTH_URL, apiKey: KEY });
  await client.ping();
  client.close();
});

test("helpers: the audio frame header and a WAV for download", () => {
  const id = new TextEncoder().encode("u1");
  const frame = new Uint8Array([0x43, 0x43, 1, 1, 7, 0, 0, 0, id.length, ...id, 9, 8]);
  assert.deepEqual(unpackAudio(frame.buffer), { id: "u1", seq: 7, last: true, payload: new Uint8Array([9, 8]).buffer });
  const wav = wavFromPcm16(new Uint8Array(4), 16000);
  assert.equal(new TextDecoder().decode(wav.slice(0, 4)), "RIFF");
  assert.equal(new DataView(wav.buffer).getUint32(24, true), 16000);
  assert.equal(wav.byteLength, 48);
});

test("a browser token from POST /v1/tokens opens the socket; a forged one is unauthorized", async () => {
  const minted = await fetch(`${process.env.CLONECAST_AUTH_HTTP}/v1/tokens`, {
    method: "POST",
    headers: { Authorization: `Bearer ${KEY}`, "Content-Type": "application/json" },
    body: JSON.stringify({ ttl_s: 60 }),
  });
  assert.equal(minted.status, 201);
  const { token } = await minted.json();
  const client = await connect({ url: AUTH_URL, token });
  await client.ping();
  client.close();
  const forged = await connect({ url: AUTH_URL, token: `${token.slice(0, -3)}xyz` }).catch((e) => e);
  assert.equal(forged.code, "unauthorized");
  assert.match(forged.detail, /signature/);
});

test("an utterance that hears nothing within its timeout fails with timeout (retryable)", async () => {
  await withClient(async (client) => {
    const utt = client.stream({ timeoutMs: 200 }); // never appended to: the server never hears of it
    const started = Date.now();
    const error = await utt.wait().then(() => null, (e) => e);
    assert.equal(error?.code, "timeout");
    assert.equal(error.retryable, true);
    assert.ok(Date.now() - started >= 190);
    await client.ping(); // the connection is fine
  });
});

test("the server's transient refusals are retryable; a bad request is not", () => {
  for (const code of ["rate_limited", "not_ready", "draining", "server_restarting"]) {
    assert.equal(new ClonecastError(code, "later").retryable, true, code);
  }
  assert.equal(new ClonecastError("bad_parameter", "no").retryable, false);
});

test("a client that floods the socket is closed with 1008, named rate_limited (retryable)", async () => {
  const client = await connect({ url: URL_ });
  const closed = new Promise((resolve) => client.addEventListener("close", (e) => resolve(e.error)));
  // the default buckets: a burst of 100 served, then 100 refused, then the connection is
  // closed; the refused pings reject with the server's rate_limited, the unanswered with the
  // close's
  const pings = Array.from({ length: 400 }, () => client.ping().catch((e) => e));
  const error = await closed;
  assert.equal(error.code, "rate_limited");
  assert.equal(error.retryable, true);
  const unanswered = (await Promise.all(pings)).filter((p) => p instanceof ClonecastError);
  assert.ok(unanswered.length >= 200, String(unanswered.length));
  assert.ok(unanswered.every((e) => e.code === "rate_limited"));
});

test("a refused ping rejects alone; the others get their pongs and the socket stays", async () => {
  await withClient(async (client) => {
    // over the connection's burst of 100 messages: the last few are refused, not the socket
    const results = await Promise.all(
      Array.from({ length: 110 }, () => client.ping().then((pong) => pong, (e) => e)),
    );
    const refused = results.filter((r) => r instanceof ClonecastError);
    assert.ok(refused.length >= 1 && refused.length <= 10, String(refused.length));
    assert.ok(refused.every((e) => e.code === "rate_limited" && e.retryable));
    assert.equal(results.filter((r) => r.type === "pong").length, 110 - refused.length);
    await new Promise((resolve) => setTimeout(resolve, 500)); // the bucket refills
    assert.equal((await client.ping()).type, "pong");
  });
});
