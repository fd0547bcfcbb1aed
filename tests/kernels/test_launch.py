"""The PDL launch switch (kernels/launch.py): scoped to a block, nested scopes restore the
outer setting, and only a GPU of compute capability 9.0+ supports it. Kernels under PDL run in
the CUDA tests (`test_pdl_gives_the_same_rows`)."""

from __future__ import annotations

import torch

from kernels.launch import pdl_launch, pdl_supported, use_pdl


def test_use_pdl_is_scoped_and_nests():
    assert pdl_launch() == {"PDL": False}
    with use_pdl(True):
        assert pdl_launch() == {"PDL": True, "launch_pdl": True}
        with use_pdl(False):
            assert pdl_launch() == {"PDL": False}
        assert pdl_launch()["PDL"] is True
    assert pdl_launch() == {"PDL": False}


def test_only_hopper_or_later_supports_it():
    assert not pdl_supported("cpu")
    if torch.cuda.is_available():
        major = torch.cuda.get_device_capability()[0]
        assert pdl_supported("cuda") == (major >= 9)
