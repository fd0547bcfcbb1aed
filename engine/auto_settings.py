"""EngineConfig's automatic settings resolved against the device and the loaded model.

`None` means "wherever it applies"; `True` on a setting that cannot apply is a ConfigError, so
a user who asks for a feature learns at start-up that this machine or checkpoint cannot give
it, instead of getting a slower path silently.
"""

from __future__ import annotations

import torch

from engine.config import ConfigError


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """EngineConfig.dtype: auto -> bfloat16 on a GPU, float32 on the CPU."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def resolve_pdl(setting: bool | None, fused: bool, device: torch.device) -> bool:
    """EngineConfig.pdl: None -> wherever it applies; True -> required."""
    from kernels.launch import pdl_supported

    supported = fused and pdl_supported(device)
    if setting is True and not supported:
        raise ConfigError("pdl=True needs fused kernels on a GPU of compute capability 9.0+")
    return supported if setting is None else bool(setting)


def resolve_skinny_tma(setting: bool | None, model, device: torch.device) -> bool:
    """EngineConfig.skinny_gemm_tma: None -> wherever it applies; True -> required. TMA tiles
    need compute capability 9.0+ and every projection's input rows 16-byte aligned."""
    from kernels.skinny_gemm import tma_supported

    cfg = model.config
    inputs = (cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.intermediate_size)
    item = model.embed_tokens.weight.element_size()
    supported = tma_supported(device, item, *inputs)
    if setting is True and not supported:
        raise ConfigError(
            "skinny_gemm_tma=True needs a GPU of compute capability 9.0+ and projection "
            f"inputs of 16-byte rows (got {inputs} x {item} bytes)"
        )
    return supported if setting is None else bool(setting)
