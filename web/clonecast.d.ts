// Types of clonecast.js: the client of the clonecast.v1 WebSocket protocol (docs/protocol.md).

export const PROTOCOL: "clonecast.v1";
export const DEFAULT_URL: string;

export class ClonecastError extends Error {
  /** The server's error code (docs/protocol.md) or a connection failure: connection_failed,
   * connection_closed, closed, timeout, or a close code's name (unauthorized, ...). */
  readonly code: string;
  readonly detail: string;
  /** The utterance it ended, if any. */
  readonly id: string | null;
  /** The request_id of the message it answers, if any. */
  readonly requestId: string | null;
  /** Whether the same request may succeed later (capacity, transient failures). */
  readonly retryable: boolean;
  constructor(code: string, message: string, opts?: { id?: string | null; requestId?: string | null });
}

export interface WebSocketLike {
  binaryType: string;
  send(data: string | ArrayBufferLike | ArrayBufferView): void;
  close(code?: number, reason?: string): void;
  addEventListener(type: string, listener: (event: any) => void): void;
  removeEventListener(type: string, listener: (event: any) => void): void;
}

export interface ConnectOptions {
  url?: string;
  /** Sent as the `bearer.KEY` subprotocol, never in the URL. Servers only: in a browser use a token. */
  apiKey?: string | null;
  /** A short-lived browser token from POST /v1/tokens, sent as `?token=`. */
  token?: string | null;
  /** A WebSocket constructor (default: globalThis.WebSocket), e.g. the `ws` package's. */
  WebSocket?: new (url: string, protocols?: string[]) => WebSocketLike;
  /** How long to wait for the server's `ready` (default 30000 ms). */
  timeoutMs?: number;
}

export interface SamplingParams {
  temperature?: number;
  top_k?: number;
  top_p?: number;
  seed?: number;
  max_duration_s?: number;
}

export interface OutputFormat {
  format?: "pcm16" | "f32" | "mulaw" | "wav";
  sampleRate?: 8000 | 16000 | 22050 | 24000 | 44100 | 48000;
}

export type AudioBytes = ArrayBuffer | ArrayBufferView;

export interface SpeakOptions {
  id?: string;
  voiceId?: string;
  voice?: { audio: AudioBytes; transcript?: string };
  params?: SamplingParams;
  output?: OutputFormat;
  /** Fail the utterance (and cancel it) when nothing arrives for this long; 0: never. */
  timeoutMs?: number;
}

export interface Chunk {
  seq: number;
  last: boolean;
  /** The audio bytes, in the utterance's output format. */
  data: ArrayBuffer;
  startMs: number | null;
  endMs: number | null;
  format?: string;
  sampleRate?: number;
}

export interface Segment {
  index: number;
  text: string;
  start_ms: number;
}

export interface DoneMessage {
  type: "done";
  id: string;
  reason: "eos" | "length";
  stats: {
    first_audio_ms: number | null;
    audio_s: number;
    elapsed_s: number;
    rtf: number | null;
    chunks: number;
    bytes: number;
    segments: number;
    underruns: number;
  };
}

export interface VoiceCreated {
  type: "voice.created";
  voice_id: string;
  frames: number;
  duration_s: number;
  transcript: string | null;
  cached: boolean;
  request_id: string;
}

/** Events: "started", "segment" (event.segment), "audio" (event.chunk), "done" and
 * "cancelled" (event.message), "error" (event.error). */
export class Utterance extends EventTarget implements AsyncIterable<Chunk> {
  readonly id: string;
  started: object | null;
  segments: Segment[];
  done: DoneMessage | null;
  error: ClonecastError | null;
  append(text: string): void;
  flush(): Promise<void>;
  cancel(): Promise<void>;
  wait(): Promise<DoneMessage | { type: "cancelled"; id: string }>;
  collect(): Promise<Uint8Array>;
  [Symbol.asyncIterator](): AsyncIterator<Chunk>;
}

/** Events: "error" (event.error: a server error about no utterance), "close" (event.error). */
export class Client extends EventTarget {
  readonly ready: object;
  readonly sessionId: string;
  readonly sampleRate: number;
  readonly modelUntrained: boolean;
  readonly limits: Record<string, number>;
  closedError: ClonecastError | null;
  createVoice(audio: AudioBytes, transcript?: string | null): Promise<VoiceCreated>;
  speak(text: string, opts?: SpeakOptions): Utterance;
  stream(opts?: SpeakOptions): Utterance;
  ping(): Promise<{ type: "pong"; t: number; request_id?: string }>;
  close(): void;
}

export function connect(opts?: ConnectOptions): Promise<Client>;
export function unpackAudio(buffer: ArrayBuffer): { id: string; seq: number; last: boolean; payload: ArrayBuffer };
export function wavFromPcm16(pcm: AudioBytes, sampleRate?: number): Uint8Array;
