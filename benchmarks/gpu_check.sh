#!/usr/bin/env bash
# One call on the H200: environment report, the whole test suite (CUDA tests included), then
# the decode-step table and the codec throughput table. Logs go to $OUT; the short tables
# print last. The full-size random checkpoint (with its codec) is written once to /tmp/full-codec.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
# Packages the GPU image lacks travel as wheels in .whl (see .library device README).
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
fi
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -c "import sys, torch, transformers, triton; print(sys.version.split()[0], torch.__version__, transformers.__version__, triton.__version__, torch.cuda.get_device_name())" | tee "$OUT/env.txt"
python3 -c "from pathlib import Path; from benchmarks.serve_bench import write_full; write_full(Path('/tmp/full-codec'))"
export CLONECAST_FULL_CKPT=/tmp/full-codec
python3 -m pytest -q -rs -p no:cacheprovider ${PYTEST_ARGS:-tests} -s 2>&1 | tee "$OUT/tests.log" | grep -E "passed|failed|error|worst|rel err|FAILED|Error" | tail -20
python3 benchmarks/eager_step.py --ckpt /tmp/full-codec --profile "$OUT/profile.txt" ${STEP_ARGS:-} 2>&1 | tee "$OUT/eager_step.log" | tail -14
[ -n "${SKIP_CODEC:-}" ] || python3 benchmarks/codec_throughput.py 2>&1 | tee "$OUT/codec_throughput.log" | tail -26
