"""What FP8 weights (`quantization="fp8"`) cost in accuracy, next to bf16, on a checkpoint
(the full-size random one on the GPU): both engines against an fp32 reference (transformers'
Qwen3, full recompute) over the same greedy clone requests.

Per engine: the hidden-state and audio-logit relative error of every step (worst and median),
and teacher-forced greedy agreement (the share of the 8 codebooks whose argmax equals the
reference's on the same inputs); then free-running greedy agreement of fp8 against bf16 (the
share of equal codes until the rows first differ, and that step). Random weights say nothing
of speech quality: that needs the real checkpoint and listening or an ASR / speaker metric.

    python benchmarks/quantization_error.py --ckpt DIR [--requests 4] [--rows 24]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine import Engine, EngineConfig, SamplingParams, VoiceReference  # noqa: E402
from tests.engine.parity import HiddenRecorder, rel_err, request_inputs  # noqa: E402
from tests.engine.reference import ReferenceModel  # noqa: E402


def _requests(n: int, frames: int, rows: int) -> list:
    import random

    out = []
    for i in range(n):
        rng = random.Random(i)
        codes = tuple(tuple(rng.randrange(1024) for _ in range(8)) for _ in range(frames))
        voice = VoiceReference(codes, f"reference transcript number {i}")
        params = SamplingParams(temperature=0, max_rows=rows)
        out.append((f"q{i}", f"Measuring what fp8 weights cost, request {i}.", voice, params))
    return out


def run_engine(ckpt: str, quantization: str, requests: list, device: str) -> tuple:
    """(prompts, rows, recorder, engine) of one eager engine over `requests` at once."""
    cfg = EngineConfig(
        device=device,
        dtype="bfloat16" if device == "cuda" else "float32",
        max_num_seqs=16,
        num_kv_blocks=1024,
        enforce_eager=True,  # the recorder's forward hook; graphs replay the same numbers
        quantization=quantization,
    )
    engine = Engine.from_pretrained(ckpt, cfg)
    recorder = HiddenRecorder(engine)
    prompts, rows = {}, {}
    for rid, text, voice, params in requests:
        engine.add_request(rid, text, reference=voice, params=params, audio=False)
        prompts[rid] = engine.scheduler.requests[rid].prompt
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                rows[out.request_id] = out.rows
    return prompts, rows, recorder, engine


def measure(engine, recorder, reference, prompts, rows) -> dict:
    """Errors of every chunk's hidden states and last-position logits, and the share of
    codebooks whose argmax matches the reference's there."""
    hidden_err, logit_err, agree = [], [], []
    for chunks, hidden in recorder.steps:
        offset = 0
        for rid, start, n in chunks:
            ids, inputs = request_inputs(prompts, rows, rid)
            ref_h = reference.hidden(ids[: start + n], inputs[: start + n]).float()
            ours = hidden[offset : offset + n].to(ref_h.device)
            hidden_err.append(rel_err(ours, ref_h[start : start + n]))
            ref_l = reference.audio_logits(ref_h[-1:].to(reference.dtype))
            weight = engine.model.audio_embed.weight
            our_l = engine.model.audio_logits(ours[-1:].to(weight.device, weight.dtype))
            logit_err.append(rel_err(our_l, ref_l))
            agree.append(float((our_l.argmax(-1) == ref_l.argmax(-1)).float().mean()))
            offset += n
    return {
        "steps": len(hidden_err),
        "hidden_max": max(hidden_err),
        "hidden_median": statistics.median(hidden_err),
        "logits_max": max(logit_err),
        "logits_median": statistics.median(logit_err),
        "argmax_agree": statistics.mean(agree),
    }


def free_running(rows_a: dict, rows_b: dict) -> tuple[float, float]:
    """(share of equal codes over every request's rows, mean first row index that differs;
    the row count where none does)."""
    equal = total = 0
    firsts = []
    for rid, a in rows_a.items():
        b = rows_b[rid]
        first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(a))
        firsts.append(first)
        for x, y in zip(a, b, strict=False):
            equal += sum(int(p == q) for p, q in zip(x, y, strict=True))
            total += len(x)
    return equal / max(total, 1), statistics.mean(firsts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--frames", type=int, default=120, help="reference frames a request")
    ap.add_argument("--rows", type=int, default=24, help="greedy rows a request")
    ap.add_argument("--device", default="cuda", help="cpu: the script's own check (fp32)")
    args = ap.parse_args()
    requests = _requests(args.requests, args.frames, args.rows)
    reference = ReferenceModel(Path(args.ckpt), dtype=torch.float32, device=args.device)
    results, all_rows = {}, {}
    for quantization in ("none", "fp8"):
        prompts, rows, recorder, engine = run_engine(args.ckpt, quantization, requests, args.device)
        results[quantization] = measure(engine, recorder, reference, prompts, rows)
        all_rows[quantization] = rows
        del engine, recorder
        torch.cuda.empty_cache()
    share, first = free_running(all_rows["none"], all_rows["fp8"])
    where = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    print(f"\nweights against fp32, {where}, {args.ckpt}")
    print(
        f"{args.requests} greedy clone requests, {args.frames}-frame references, {args.rows} rows"
    )
    print("weights  chunks  hidden max  hidden median  logits max  logits median  argmax agree")
    for name, r in results.items():
        label = name if name != "none" else ("bf16" if args.device == "cuda" else "fp32")
        print(
            f"{label:<8}{r['steps']:>7}{r['hidden_max']:>12.2e}{r['hidden_median']:>15.2e}"
            f"{r['logits_max']:>12.2e}{r['logits_median']:>15.2e}{r['argmax_agree']:>13.1%}"
        )
    print(
        f"free-running greedy, fp8 vs bf16: {share:.1%} of codes equal, rows first differ at "
        f"row {first:.1f} on average (of {args.rows})"
    )
    print("speech quality: unmeasured (random weights)")


if __name__ == "__main__":
    main()
