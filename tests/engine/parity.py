"""Harness shared by the CPU and CUDA parity tests: run the engine while recording each
step's hidden states, then recompute every chunk with the reference model."""

from __future__ import annotations

import torch

from engine import Engine


class HiddenRecorder:
    """Records (chunks, hidden) for every step the engine runs."""

    def __init__(self, engine: Engine):
        self.steps: list[tuple[list[tuple[str, int, int]], torch.Tensor]] = []
        self._pending = None
        engine.model.register_forward_hook(self._hook)
        original = engine.runner.launch

        def launch(sched):
            self._pending = [(c.request.request_id, c.start, c.num_tokens) for c in sched.chunks]
            return original(sched)

        engine.runner.launch = launch

    def _hook(self, module, args, output):
        self.steps.append((self._pending, output.detach().float().cpu()))


def request_inputs(prompts: dict, rows: dict, rid: str):
    """Full input sequence of a finished or running request: prompt + fed-back rows."""
    prompt = prompts[rid]
    ids = list(prompt.token_ids) + [0] * len(rows[rid])
    inputs = list(prompt.audio_rows) + list(rows[rid])
    return ids, inputs


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def check_all_chunks(engine, recorder, reference, prompts, rows, tol):
    """Compares every recorded chunk's hidden states (and the audio logits of its last
    position) with a full recompute. Returns the worst relative errors seen."""
    worst_h = worst_l = 0.0
    checked = 0
    for chunks, hidden in recorder.steps:
        offset = 0
        for rid, start, n in chunks:
            ids, inputs = request_inputs(prompts, rows, rid)
            ref_h = reference.hidden(ids[: start + n], inputs[: start + n]).float().cpu()
            ours = hidden[offset : offset + n]
            e_h = rel_err(ours, ref_h[start : start + n])
            ref_l = reference.audio_logits(ref_h[-1:].to(reference.dtype).to(reference.device))
            model = engine.model
            last = ours[-1:].to(model.embed_tokens.weight.device, model.embed_tokens.weight.dtype)
            our_l = model.audio_logits(last)
            e_l = rel_err(our_l.cpu(), ref_l.cpu())
            assert e_h <= tol and e_l <= tol, (rid, start, n, e_h, e_l)
            worst_h, worst_l = max(worst_h, e_h), max(worst_l, e_l)
            offset += n
            checked += 1
    return worst_h, worst_l, checked
