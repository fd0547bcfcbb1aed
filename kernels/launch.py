"""Programmatic dependent launch (PDL, Hopper and later): a kernel launched with it may start
while the kernel before it in the stream is still finishing, and waits (`griddepcontrol.wait`)
before it touches anything that kernel wrote. The launch gaps and tails of a decode step's
~360 kernels overlap instead of adding up.

Which launches use it is decided by the caller around the forward pass (`use_pdl`), so the
kernels stay plain functions of tensors. Every kernel that honours it waits first thing, before
any read or write (`pdl_enter`, also before an early return: a kernel whose programs all left
without waiting could complete before its predecessor, and its successor's wait would then not
cover that predecessor), and lets its own successor launch once all its programs have started.
Torch's kernels and cuBLAS launch without it: they start after the previous kernel completes.
"""

from __future__ import annotations

import contextlib
import contextvars

import triton
import triton.language as tl

_PDL = contextvars.ContextVar("clonecast_pdl", default=False)


@contextlib.contextmanager
def use_pdl(enabled: bool):
    """Kernel launches inside the block use PDL when `enabled` (eager or while capturing)."""
    token = _PDL.set(bool(enabled))
    try:
        yield
    finally:
        _PDL.reset(token)


def pdl_launch() -> dict:
    """Keyword arguments for a launch: the `PDL` constexpr and, when on, `launch_pdl`."""
    if _PDL.get():
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


def hopper_or_later(device) -> bool:
    """A CUDA device of compute capability 9.0 or later (PDL, TMA tensor descriptors)."""
    import torch

    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def pdl_supported(device) -> bool:
    """PDL needs a CUDA device of compute capability 9.0 or later."""
    return hopper_or_later(device)


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """Start of a PDL kernel: wait for the previous kernel's writes, then let the next kernel
    launch once every program of this one has started (it waits for ours in turn)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
