#!/usr/bin/env bash
# One device call of a working round: selected CUDA tests, the engine-alone loop (async vs
# sync scheduling, with a profile), a reduced served run, then the GEMM table. Logs in $OUT.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
if [ -d .whl ]; then
  python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null && export PYTHONPATH=/tmp/site:$PWD
fi
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
[ -n "${TESTS:-}" ] && python3 -m pytest -q -p no:cacheprovider -x $TESTS 2>&1 | tee "$OUT/tests.log" | grep -E "passed|failed|FAILED|Error" | tail -8
python3 -c "from pathlib import Path; from benchmarks.serve_bench import write_full; write_full(Path('/tmp/full-codec'))"
[ -n "${LOOP:-1}" ] && timeout 300 python3 benchmarks/engine_loop.py --model /tmp/full-codec --concurrency ${LOOP_C:-1,32,64} --warmup-s 4 --timed-s 6 --profile "$OUT/loop_profile.txt" 2>&1 | tee "$OUT/engine_loop.log" | grep -v "^{" | tail -9
[ -n "${SERVE:-1}" ] && timeout 300 python3 benchmarks/serve_bench.py --model /tmp/full-codec --concurrency ${SERVE_C:-1,64} --requests ${SERVE_N:-0} --warmup -1 --starts 1 --out "$OUT/serve" 2>&1 | tail -6
[ -n "${GEMM:-}" ] && timeout 200 python3 benchmarks/gemm_shapes.py --batches ${GEMM_B:-1,64,128} 2>&1 | tee "$OUT/gemm.log" | tail -17
true
