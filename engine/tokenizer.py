"""Text tokenization for prompts: the checkpoint's tokenizer plus the ids of the five added
tokens, resolved at load time (never hard-coded). Text is encoded without special tokens.
"""

from __future__ import annotations

import threading
from pathlib import Path

from engine.config import ADDED_TOKENS, ConfigError
from engine.prompt import SpecialTokens

_CACHE_ENTRIES = 4096  # texts whose ids are kept (oldest dropped first)
# Engines start in parallel threads, and transformers' lazy imports are not thread-safe (two
# first imports at once: "cannot import name 'AutoTokenizer'").
_LOAD_LOCK = threading.Lock()


def _load(path: Path):
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    # transformers warns that config.json's model_type is unknown to it; it is ours.
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as exc:
        raise ConfigError(f"cannot load the tokenizer from {path}: {exc}") from exc
    finally:
        hf_logging.set_verbosity(verbosity)


class HiggsTokenizer:
    def __init__(self, path: Path):
        with _LOAD_LOCK:
            self._tok = _load(path)
        vocab = self._tok.get_vocab()
        missing = [t for t in ADDED_TOKENS if t not in vocab]
        if missing:
            raise ConfigError(
                f"the tokenizer in {path} lacks the added token(s) {missing}; a Higgs v3 "
                f"tokenizer defines {list(ADDED_TOKENS)}"
            )
        ids = [vocab[t] for t in ADDED_TOKENS]
        self.special = SpecialTokens(*ids)
        self._cache: dict[str, tuple[int, ...]] = {}
        self._cache_lock = threading.Lock()

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`. Recent results are kept: a voice's transcript is encoded for
        every request that uses it, and the service checks a text before the engine builds
        its prompt."""
        ids = self._cache.get(text)
        if ids is None:
            ids = tuple(self._tok.encode(text, add_special_tokens=False))
            with self._cache_lock:  # the event loop and the engine thread both encode
                if len(self._cache) >= _CACHE_ENTRIES:
                    self._cache.pop(next(iter(self._cache)))  # the oldest entry
                self._cache[text] = ids
        return list(ids)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)

    def __len__(self) -> int:
        return len(self._tok)
