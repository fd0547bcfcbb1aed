// Microphone capture in an AudioWorklet (a default-rate AudioContext: the microphone's own
// rate, which Firefox requires): raw float samples, mixed to mono, posted to the page about
// ten times a second. The page encodes them as a 16-bit WAV (MediaRecorder's WebM cannot be
// decoded by the server).

class ClonecastRecorder extends AudioWorkletProcessor {
  constructor() {
    super();
    this.block = new Float32Array(Math.ceil(sampleRate / 10));
    this.filled = 0;
    this.port.onmessage = (event) => {
      if (event.data === "flush") this.flush();
    };
  }

  flush() {
    if (this.filled === 0) return;
    this.port.postMessage(this.block.slice(0, this.filled));
    this.filled = 0;
  }

  process(inputs) {
    const channels = inputs[0];
    if (!channels || channels.length === 0) return true;
    const n = channels[0].length;
    for (let i = 0; i < n; i += 1) {
      let sum = 0;
      for (const channel of channels) sum += channel[i];
      this.block[this.filled] = sum / channels.length;
      this.filled += 1;
      if (this.filled === this.block.length) this.flush();
    }
    return true;
  }
}

registerProcessor("clonecast-recorder", ClonecastRecorder);
