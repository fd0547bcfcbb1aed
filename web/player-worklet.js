// Gapless playback of streamed PCM16 in an AudioWorklet (a 24 kHz playback AudioContext).
// The main thread transfers each chunk's PCM16 buffer; this processor keeps a ring buffer
// allocated once (nothing is allocated in process()), starts on the first chunk, fades 5 ms
// in at every start and out at every stop or underrun, and counts underruns: output frames
// that had to be silence between the first chunk and the end of the stream.

const RING_SECONDS = 16;
const FADE_MS = 5;
const REPORT_MS = 80;

class ClonecastPlayer extends AudioWorkletProcessor {
  constructor() {
    super();
    this.ring = new Float32Array(Math.ceil(sampleRate * RING_SECONDS));
    this.readAt = 0;
    this.writeAt = 0;
    this.buffered = 0;
    this.fadeFrames = Math.round((sampleRate * FADE_MS) / 1000);
    this.gain = 0; // 0..1, ramped over fadeFrames
    this.playing = false; // a stream started and has not ended or stopped
    this.ended = false; // the server sent the last chunk: running dry is the end, no underrun
    this.starving = false; // in an underrun now
    this.framesPlayed = 0;
    this.underrunFrames = 0;
    this.underruns = 0;
    this.dropped = 0; // samples that did not fit the ring (a client far behind)
    this.sinceReport = 0;
    this.reportEvery = Math.round((sampleRate * REPORT_MS) / 1000);
    this.port.onmessage = (event) => this.onMessage(event.data);
  }

  onMessage(message) {
    if (message.type === "pcm") {
      const pcm = new Int16Array(message.pcm);
      for (let i = 0; i < pcm.length; i += 1) {
        if (this.buffered === this.ring.length) {
          this.dropped += pcm.length - i;
          break;
        }
        this.ring[this.writeAt] = pcm[i] / 32768;
        this.writeAt = (this.writeAt + 1) % this.ring.length;
        this.buffered += 1;
      }
      if (!this.playing) {
        this.playing = true;
        this.ended = false;
        this.gain = 0; // fade in from silence
      }
    } else if (message.type === "end") {
      this.ended = true;
    } else if (message.type === "stop" || message.type === "reset") {
      this.stopping = message.type === "stop"; // fade out what plays, then drop the rest
      if (!this.stopping) this.clear();
      this.ended = true;
    }
    if (message.type === "reset") {
      this.framesPlayed = this.underrunFrames = this.underruns = this.dropped = 0;
    }
    this.report();
  }

  clear() {
    this.readAt = this.writeAt = this.buffered = 0;
    this.playing = false;
    this.starving = false;
    this.stopping = false;
    this.gain = 0;
  }

  process(_inputs, outputs) {
    const out = outputs[0][0];
    const step = 1 / this.fadeFrames;
    for (let i = 0; i < out.length; i += 1) {
      if (!this.playing) {
        out[i] = 0;
        continue;
      }
      if (this.stopping) {
        // the 5 ms fade-out of a stop: keep reading while the gain goes down
        this.gain -= step;
        if (this.gain <= 0 || this.buffered === 0) {
          this.clear();
          out[i] = 0;
          continue;
        }
      } else if (this.buffered === 0) {
        if (this.ended) {
          this.clear(); // the stream is over: silence is the end, not an underrun
          out[i] = 0;
          continue;
        }
        if (!this.starving) {
          this.starving = true;
          this.underruns += 1;
        }
        this.underrunFrames += 1;
        this.gain = 0; // the next sample fades in again
        out[i] = 0;
        continue;
      } else {
        this.starving = false;
        this.gain = Math.min(1, this.gain + step);
        // fade out ahead of running dry: the last fadeFrames samples before an empty ring
        if (this.buffered < this.fadeFrames && !this.ended) {
          this.gain = Math.min(this.gain, this.buffered / this.fadeFrames);
        }
      }
      out[i] = this.ring[this.readAt] * this.gain;
      this.readAt = (this.readAt + 1) % this.ring.length;
      this.buffered -= 1;
      this.framesPlayed += 1;
    }
    for (let c = 1; c < outputs[0].length; c += 1) outputs[0][c].set(out);
    this.sinceReport += out.length;
    if (this.sinceReport >= this.reportEvery) this.report();
    return true; // a gap never ends the node
  }

  report() {
    this.sinceReport = 0;
    this.port.postMessage({
      framesPlayed: this.framesPlayed,
      underruns: this.underruns,
      underrunFrames: this.underrunFrames,
      buffered: this.buffered,
      dropped: this.dropped,
      playing: this.playing,
    });
  }
}

registerProcessor("clonecast-player", ClonecastPlayer);
