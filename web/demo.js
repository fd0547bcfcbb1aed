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
};
window.__clonecast = state;

let client = null;
let utterance = null;
let audio = null; // {context, node}
let received = []; // this utterance's PCM16 chunks, for the download

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

async function ensureAudio() {
  if (audio) return audio;
  const context = new AudioContext({ sampleRate: 24000 }); // the server's rate: no resampling
  await context.audioWorklet.addModule("player-worklet.js");
  const node = new AudioWorkletNode(context, "clonecast-player", { outputChannelCount: [1] });
  node.port.onmessage = (event) => show({
    framesPlayed: event.data.framesPlayed,
    underruns: event.data.underruns,
    underrunFrames: event.data.underrunFrames,
  });
  node.connect(context.destination);
  audio = { context, node };
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
  $("error").hidden = true;
  state.error = null;
  try {
    const [c, player] = await Promise.all([ensureClient(), ensureAudio()]);
    await player.context.resume();
    const opts = { params: params() };
    const file = $("voice-file").files[0];
    if (file) {
      show({ state: "encoding the voice" });
      const voice = await c.createVoice(await file.arrayBuffer(), $("transcript").value || null);
      opts.voiceId = voice.voice_id;
    }
    player.node.port.postMessage({ type: "reset" });
    received = [];
    show({ state: "speaking", chunks: 0, bytes: 0, ttfaMs: null, serverTtfaMs: null, captions: [] });
    $("caption").textContent = "";
    $("stop").disabled = false;
    $("speak").disabled = true;
    $("download").disabled = true;
    const sent = performance.now();
    utterance = c.speak($("text").value, opts);
    utterance.addEventListener("segment", (e) => {
      state.captions.push(e.segment.text);
      $("caption").textContent = e.segment.text;
    });
    for await (const chunk of utterance) {
      if (state.ttfaMs === null) show({ ttfaMs: performance.now() - sent });
      const size = chunk.data.byteLength; // (the buffer is transferred to the player below)
      received.push(chunk.data.slice(0));
      player.node.port.postMessage({ type: "pcm", pcm: chunk.data }, [chunk.data]);
      show({ chunks: state.chunks + 1, bytes: state.bytes + size });
    }
    player.node.port.postMessage({ type: "end" });
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
  }
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
  const url = URL.createObjectURL(new Blob([wavFromPcm16(pcm, 24000)], { type: "audio/wav" }));
  const link = Object.assign(document.createElement("a"), { href: url, download: "clonecast.wav" });
  link.click();
  setTimeout(() => URL.revokeObjectURL(url), 1000);
}

$("insecure").hidden = window.isSecureContext;
$("speak-form").addEventListener("submit", speak);
$("stop").addEventListener("click", stop);
$("download").addEventListener("click", download);
ensureClient().catch(showError); // shows the untrained-model banner before the first speak
show({});
