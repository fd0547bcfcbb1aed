"""clonecast engine: Higgs Audio v3 generation with continuous batching and a paged KV cache.

Public API (everything else in this package is internal):
- `Engine`: create with `Engine.from_pretrained(path_or_hub_id_or_None, EngineConfig(...))`,
  then `add_request`, `abort`, `step`, `has_unfinished`, `rows`, `generate`, `stats`.
- `EngineConfig`, `SamplingParams`, `VoiceReference`: inputs, validated on construction.
- `RequestOutput`, `GenerationResult`, `EngineStats`: outputs.
- `ConfigError`: every rejected input or checkpoint.
- `UNTRAINED_NOTICE`: what to show whenever the embedded default model is in use.
"""

from engine.checkpoint_writer import UNTRAINED_NOTICE
from engine.config import ConfigError, EngineConfig, SamplingParams, VoiceReference
from engine.engine import Engine, EngineStats, GenerationResult, RequestOutput

__all__ = [
    "UNTRAINED_NOTICE",
    "ConfigError",
    "Engine",
    "EngineConfig",
    "EngineStats",
    "GenerationResult",
    "RequestOutput",
    "SamplingParams",
    "VoiceReference",
]
