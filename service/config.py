"""Service settings: the only module that reads environment variables.

CLONECAST_MODEL (checkpoint dir or hub id; unset = embedded default), CLONECAST_DEVICE
(cpu/cuda; unset = cuda when available), CLONECAST_CACHE_DIR (where the default model is
written; unset = ~/.cache/clonecast).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ServiceSettings:
    model: str | None
    device: str | None
    cache_dir: Path | None

    @classmethod
    def from_env(cls) -> ServiceSettings:
        cache = os.environ.get("CLONECAST_CACHE_DIR")
        return cls(
            model=os.environ.get("CLONECAST_MODEL") or None,
            device=os.environ.get("CLONECAST_DEVICE") or None,
            cache_dir=Path(cache) if cache else None,
        )
