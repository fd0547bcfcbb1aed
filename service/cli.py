"""The `clonecast` command line. For now: `clonecast generate`, which runs the engine on a
text and writes the generated delayed audio-code rows to a JSON file (the codec that turns
them into a WAV comes with the codec work)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from engine import UNTRAINED_NOTICE, ConfigError, Engine, EngineConfig, SamplingParams
from service.config import ServiceSettings


def _device(requested: str | None) -> str:
    if requested:
        return requested
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def generate(args: argparse.Namespace) -> int:
    settings = ServiceSettings.from_env()
    model = args.model or settings.model
    config = EngineConfig(device=_device(args.device or settings.device), max_num_seqs=4)
    engine = Engine.from_pretrained(model, config, cache_dir=settings.cache_dir)
    if engine.is_default_model:
        print(f"note: {UNTRAINED_NOTICE}", file=sys.stderr)
    params = SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        max_rows=args.max_rows,
    )
    t0 = time.perf_counter()
    [result] = engine.generate([args.text], params=params)
    seconds = time.perf_counter() - t0
    frames = max(0, len(result.rows) - 8)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "model": str(engine.checkpoint),
                "untrained_default_model": engine.is_default_model,
                "text": args.text,
                "finish_reason": result.finish_reason,
                "delayed_rows": [list(r) for r in result.rows],
            }
        )
    )
    print(
        f"{len(result.rows)} rows ({frames / 25:.2f} s of audio, finish: {result.finish_reason}) "
        f"in {seconds:.2f} s -> {out}"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="clonecast", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate audio-code rows for a text")
    g.add_argument("--text", required=True)
    g.add_argument("--out", default="out/codes.json")
    g.add_argument("--model", help="checkpoint dir or hub id (default: embedded default model)")
    g.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    g.add_argument("--temperature", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=50)
    g.add_argument("--top-p", type=float, default=0.95)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--max-rows", type=int, default=200)
    g.set_defaults(func=generate)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
