"""Our top-level `kernels` package must not be mistaken for the Hugging Face `kernels` hub
package, which transformers probes with importlib.util.find_spec("kernels")."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_find_spec_sees_our_kernels_package():
    spec = importlib.util.find_spec("kernels")
    assert spec is not None and Path(spec.origin).resolve().parent == ROOT / "kernels"


def test_transformers_does_not_use_our_kernels_package():
    code = (
        "import sys, torch\n"
        "from transformers.utils.import_utils import is_kernels_available\n"
        "from transformers import Qwen3Config, Qwen3Model\n"
        "assert not is_kernels_available()\n"
        "cfg = Qwen3Config(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,\n"
        "    num_key_value_heads=1, head_dim=16, intermediate_size=64, vocab_size=50)\n"
        "out = Qwen3Model(cfg)(input_ids=torch.tensor([[1, 2, 3]])).last_hidden_state\n"
        "assert out.shape == (1, 3, 32)\n"
        "print('ok')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("ok")
