"""Reference audio -> codes `[T, 8]` with the checkpoint's bundled encoder (HuBERT semantic
branch + DAC acoustic encoder + RVQ), through transformers' `HiggsAudioV2TokenizerModel`.

Encoding a reference is a one-off per voice (and cached), so the reference implementation is
used as is; the model is built on first use, so a decoder-only codec still streams.
"""

from __future__ import annotations

import threading

import torch

from engine.codec.config import CodecConfig
from engine.codec.loader import build_reference_model
from engine.config import ConfigError


class ReferenceEncoder:
    def __init__(self, cfg: CodecConfig, state: dict[str, torch.Tensor], device: torch.device):
        self._cfg, self._state, self._device = cfg, state, device
        self._model = None
        self._lock = threading.Lock()
        self.num_encodes = 0

    def _get_model(self):
        with self._lock:
            if self._model is None:
                if not any(k.startswith("acoustic_encoder.") for k in self._state):
                    raise ConfigError(
                        "this codec has no encoder weights: voice cloning from audio needs the "
                        "full Higgs audio tokenizer (pass it as the codec)"
                    )
                self._model = build_reference_model(self._cfg, self._state, self._device)
            return self._model

    @torch.inference_mode()
    def encode(self, waveform: torch.Tensor) -> tuple[tuple[int, ...], ...]:
        """Mono 24 kHz `[M]` (M a multiple of 960) -> frames of 8 codes."""
        model = self._get_model()
        x = waveform.to(self._device, torch.float32)[None, None]
        codes = model.encode(x, return_dict=False)[0]  # [8, T]
        self.num_encodes += 1
        return tuple(tuple(int(c) for c in frame) for frame in codes.t().tolist())
