"""Our paged attention kernel at Higgs decode shapes (GQA 32/8, head_dim 128, bf16, pages of
16) over tile and pipeline settings, next to the KV-traffic floor. One table.

    python benchmarks/attention_shapes.py
"""

from __future__ import annotations

import itertools

import torch
import triton.testing

from kernels.paged_attention import paged_attention, paged_attention_reference

CASES = {
    "decode 64 x 400": ([1] * 64, [399] * 64),
    "decode 32 x 400": ([1] * 32, [399] * 32),
    "decode 1 x 2000": ([1], [1999]),
    "decode 256 x 400": ([1] * 256, [399] * 256),
    "prefill 212 + 44": ([212] + [1] * 44, [0] + [300] * 44),
}


def make(q_lens, ctx_lens):
    page, hkv, d = 16, 8, 128
    seq_lens = [q + c for q, c in zip(q_lens, ctx_lens, strict=True)]
    pages = max(-(-s // page) for s in seq_lens)
    nblocks = len(q_lens) * pages + 1
    k = torch.randn(nblocks, page, hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    tables = (torch.randperm(nblocks - 1, device="cuda")[: len(q_lens) * pages] + 1).view(
        len(q_lens), pages
    )
    qsl = torch.tensor(
        [0, *torch.tensor(q_lens).cumsum(0).tolist()], device="cuda", dtype=torch.int32
    )
    q = torch.randn(sum(q_lens), 32, d, device="cuda", dtype=torch.bfloat16)
    lens = torch.tensor(seq_lens, device="cuda", dtype=torch.int32)
    kv_bytes = sum(seq_lens) * hkv * d * 2 * 2
    return (q, k, v, qsl, lens, tables.int()), kv_bytes


def main() -> None:
    rows = []
    for name, (q_lens, ctx) in CASES.items():
        args, kv_bytes = make(q_lens, ctx)
        max_q = max(q_lens)
        ref = paged_attention_reference(*args, 128**-0.5).float()
        best = (float("inf"), "-")
        for bn, warps, stages in itertools.product((32, 64, 128), (4, 8), (2, 3, 4)):
            out = paged_attention(
                *args, 128**-0.5, max(q_lens), block_n=bn, num_warps=warps, num_stages=stages
            )
            if float((out.float() - ref).norm() / ref.norm()) > 1e-2:
                continue
            ms = triton.testing.do_bench(
                lambda a=args, m=max_q, bn=bn, w=warps, s=stages: paged_attention(
                    *a, 128**-0.5, m, block_n=bn, num_warps=w, num_stages=s
                ),
                return_mode="median",
            )
            best = min(best, (ms, f"BN={bn} warps={warps} stages={stages}"))
        default = triton.testing.do_bench(
            lambda a=args, m=max_q: paged_attention(*a, 128**-0.5, m), return_mode="median"
        )
        floor_us = kv_bytes / 4.13e12 * 1e6
        rows.append((name, default * 1e3, best[0] * 1e3, best[1], floor_us))
    print(
        "\n{:<18}{:>12}{:>10}  {:<28}{:>10}".format(
            "case", "default us", "best us", "best config", "floor us"
        )
    )
    for name, d, b, cfg, fl in rows:
        print(f"{name:<18}{d:>12.1f}{b:>10.1f}  {cfg:<28}{fl:>10.1f}")


if __name__ == "__main__":
    main()
