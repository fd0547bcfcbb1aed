"""clonecast engine: Higgs Audio v3 generation with continuous batching and a paged KV cache.

Public API (everything else in this package is internal):
- `Engine`: create with `Engine.from_pretrained(path_or_hub_id_or_None, EngineConfig(...))`,
  then `encode_reference`, `add_request`, `abort`, `step`, `has_unfinished`, `rows`,
  `generate`, `stats`, `take_observations` (`Observations`: each step's time and
  `StepShape`, one of `STEP_KINDS`; queue times; codec batch latencies).
- `EngineConfig`, `SamplingParams`, `VoiceReference`: inputs, validated on construction
- `ExecutionPlan`: how an engine runs on its device (`Engine.plan`), resolved from the config
  (`NUM_CODEBOOKS`: the width of a reference's code rows).
- `StreamConfig`, `AudioLimits`: streaming chunk sizes; reference-audio limits.
- `RequestOutput`, `AudioChunk`, `GenerationResult`, `EngineStats`: outputs.
- `ReferenceAudioError`: unusable reference audio, with a stable `code`.
- `StreamingResampler`: 24 kHz chunks to another rate, exact across chunk cuts.
- `default_device()`: "cuda" when a GPU is usable, else "cpu".
- `ConfigError`: every rejected input or checkpoint.
- Audio constants: `SAMPLE_RATE` (24 kHz), `FRAMES_PER_SECOND` (25), `FRAME_MS` (40),
  `MAX_ROWS` (2048 rows a request), `MAX_AUDIO_SECONDS` (81.6 s: the audio of MAX_ROWS).
- `UNTRAINED_NOTICE`: what to show whenever the embedded default model is in use.

Names are imported lazily so that the torch-free bookkeeping modules (config, prompt,
request, block_manager, scheduler) can be imported without loading torch.
"""

from importlib import import_module

_PUBLIC = {
    "UNTRAINED_NOTICE": "engine.checkpoint_writer",
    "ConfigError": "engine.config",
    "EngineConfig": "engine.config",
    "ExecutionPlan": "engine.plan",
    "SamplingParams": "engine.config",
    "VoiceReference": "engine.config",
    "NUM_CODEBOOKS": "engine.config",
    "SAMPLE_RATE": "engine.config",
    "FRAMES_PER_SECOND": "engine.config",
    "FRAME_MS": "engine.config",
    "MAX_AUDIO_SECONDS": "engine.config",
    "MAX_ROWS": "engine.config",
    "StreamConfig": "engine.config",
    "AudioChunk": "engine.audio_output",
    "ReferenceAudioError": "engine.codec.audio_io",
    "AudioLimits": "engine.codec.audio_io",
    "StreamingResampler": "engine.codec.resample",
    "default_device": "engine.engine",
    "Engine": "engine.engine",
    "EngineStats": "engine.stats",
    "STEP_PHASES": "engine.stats",
    "STEP_KINDS": "engine.stats",
    "DEFAULT_BUCKETS": "engine.plan",
    "GRAPH_FAMILIES": "engine.stats",
    "Observations": "engine.stats",
    "StepShape": "engine.stats",
    "GenerationResult": "engine.engine",
    "RequestOutput": "engine.audio_output",
    "TextChecker": "engine.prompt",
    "StepProfiler": "engine.profiling",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(import_module(module), name)
