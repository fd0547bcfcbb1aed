#!/usr/bin/env bash
# One call on the H200 that checks and times what is asked of it; logs go to $OUT and the
# short tables print last. The full-size random checkpoint (with its codec) is written once
# to /tmp/full-codec. Parts, by environment variable:
#   ATTN=1       the attention kernel sweep (benchmarks/attention_shapes.py)
#   GEMM=1       the cuBLAS GEMM table (GEMM_B: batch sizes, GEMM_ARGS e.g. --tunable)
#   FP8_GEMM=1   the fp8 projections: our few-row GEMM against torch._scaled_mm
#                (benchmarks/fp8_gemm.py; FP8_GEMM_ARGS e.g. "--batches 64,80,96,128 --sweep")
#   RACE=1       backbone and codec graphs replayed concurrently, captured on one stream or
#                two (benchmarks/workspace_race_probe.py, RACE_ARGS its arguments)
#   SKIP_CODEC=1 skips the codec throughput table (CODEC_ARGS: its arguments)
#   PYTEST_ARGS  tests to run (default: the whole suite; "" skips them); TESTS_K: a -k filter
#   LOOP=1       the engine alone under the served load, async vs sync (LOOP_C: concurrencies)
#   LOOP_AB      the same load per override set, e.g.
#                "noise_kernel=false+few_row_gemm_rows=0" (EngineConfig or plan fields)
#   SERVE=1      a reduced served run (SERVE_C: concurrencies, SERVE_N: timed requests,
#                SERVE_MAX: the server's max_num_seqs, else its default 64; PYSPY="D S": py-spy
#                attached D s after the server is ready for S s, server and engine process,
#                samples holding the interpreter lock, summarised by benchmarks/pyspy_top.py)
#   PROTOCOL=1   the full served protocol of docs/PERFORMANCE.md (C = 1..256, 3 fresh starts,
#                10 s timed a point); PROTOCOL_VOICES the pools (64cold; 1: one voice; one pool
#                with the timed fp16 codec's start-up may not fit a call of 600 s: split it with
#                PROTOCOL_C, e.g. 1,32,64 then 128,256), PROTOCOL_S
#   LEVERS="NAME:VAR=VALUE+VAR=VALUE ..." one served run per lever, its server started with
#                those environment variables (e.g. budget:CLONECAST_MAX_BATCHED_TOKENS=1024),
#                LEVER_VOICES the pool (64cold), LEVER_C (128,256), LEVER_STARTS (1), LEVER_ARGS,
#                LEVER_LIMIT s each (200; the first LEVER_FIRST_EXTRA more, 45: compiling);
#                LEVER_DUMP="60 120": py-spy dumps (native frames) of the server and engine
#                processes that many s after ready, in $OUT/dump-NAME.txt (needs py-spy's
#                wheel in .whl)
#   STEP_AB      the decode step (eager_step.py) per EngineConfig override set, as LOOP_AB
#   BUCKETS="a b" the backbone step per served batch shape (decodes alone and beside a
#                prompt chunk: benchmarks/bucket_cost.py) per override set, as STEP_AB, e.g.
#                "quantization=none quantization=fp8 quantization=fp8+few_row_fp8_rows=128";
#                BUCKETS_ARGS its other arguments
#   HOST=1       host work per engine step at C = 64 and 128 (benchmarks/host_cost.py)
#   GIL_MS="a b" one served start at C = 64 and 128 per GIL switch interval (ms) of the server
#   NCU=1        Nsight Compute counters of the step's largest kernels (benchmarks/ncu_targets.py,
#                NCU_ARGS its arguments); the full report in $OUT/ncu.txt
#   STEP_ARGS    extra arguments of the decode-step table (STEP=0 skips it)
#   QUANT_ERR=1  FP8 weights against bf16: errors against fp32 and greedy agreement
#                (benchmarks/quantization_error.py, QUANT_ERR_ARGS its arguments)
#   SCALE="1 2 noaff" needs two GPUs (nvidia-h200-x2): the served protocol with one engine
#                on cuda:0 (1), two on cuda:0,cuda:1 (2), two without voice affinity (noaff);
#                SCALE_VOICES the pool (64; 1: one voice), SCALE_C (64,128,256,512), one
#                start of SCALE_S s timed each; about 3-4 min a run, so two runs a call; then
#                benchmarks/scaling_report.py's table (also runnable here on the fetched files)
#   KILL=1       benchmarks/engine_kill.py on two GPUs: one engine killed under 64 streams
# Each part has its own time limit, so one slow part cannot eat the whole call.
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/clients/python PYTHONUNBUFFERED=1
# Packages the GPU image lacks travel as wheels in .whl (see .library device README). Fill it
# with `pip download --no-deps --only-binary=:all: --python-version 3.12 --platform
# manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform any anyio cffi click h11
# idna py-spy pycparser python-multipart starlette uvicorn websockets soundfile` (py-spy and
# cffi ship manylinux2014 wheels only): soundfile's manylinux wheel bundles libsndfile, which
# the image lacks; numpy and typing_extensions stay out (the image's own are used).
if [ -d .whl ]; then
  python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null && export PYTHONPATH=/tmp/site:$PWD:$PWD/clients/python
fi
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
CKPT=/tmp/full-codec
python3 -c "import sys, torch, transformers, triton; print(sys.version.split()[0], torch.__version__, transformers.__version__, triton.__version__, torch.cuda.get_device_name())" | tee "$OUT/env.txt"
python3 -c "from pathlib import Path; from engine.checkpoint_writer import write_full_size_checkpoint as w; w(Path('$CKPT'))"
export CLONECAST_FULL_CKPT=$CKPT
if [ "${ATTN:-0}" = 1 ]; then
  timeout 240 python3 benchmarks/attention_shapes.py ${ATTN_ARGS:-} 2>&1 | tee "$OUT/attention.log" | tail -12
fi
if [ "${NCU:-0}" = 1 ]; then
  NCU_BIN=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
  timeout 300 "$NCU_BIN" --clock-control none --profile-from-start off --section SpeedOfLight \
    --section Occupancy --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis \
    python3 benchmarks/ncu_targets.py ${NCU_ARGS:-} > "$OUT/ncu.txt" 2>&1
  grep -E "Context 1|^    Duration|DRAM Throughput|Achieved Occupancy|Warp Cycles Per Issued|profiled:|ERR" "$OUT/ncu.txt" | sed 's/  */ /g' | head -80
fi
if [ "${GEMM:-0}" = 1 ]; then
  timeout ${GEMM_LIMIT:-200} python3 benchmarks/gemm_shapes.py --batches ${GEMM_B:-1,64,128} ${GEMM_ARGS:-} 2>&1 | tee "$OUT/gemm.log" | grep -v "^(" | tail -32
fi
if [ "${FP8_GEMM:-0}" = 1 ]; then
  timeout ${FP8_GEMM_LIMIT:-120} python3 benchmarks/fp8_gemm.py ${FP8_GEMM_ARGS:-} 2>&1 | tee "$OUT/fp8_gemm.log" | tail -40
fi
if [ "${RACE:-0}" = 1 ]; then
  timeout ${RACE_LIMIT:-150} python3 benchmarks/workspace_race_probe.py ${RACE_ARGS:-} 2>&1 | tee "$OUT/race.log" | tail -8
fi
[ -n "${SKIP_CODEC:-}" ] || timeout 150 python3 benchmarks/codec_throughput.py ${CODEC_ARGS:-} 2>&1 | tee "$OUT/codec_throughput.log" | tail -24
TESTS=${PYTEST_ARGS-tests}
if [ -n "$TESTS" ]; then
  # modules that import what the GPU image lacks (openai, psycopg...) have no CUDA tests:
  # their collection errors are reported without stopping the rest
  # stopped at the limit with SIGINT, pytest still prints its summary and the slowest tests
  timeout -s INT -k 20 ${TESTS_LIMIT:-400} python3 -m pytest -q -rs -p no:cacheprovider --durations=15 --continue-on-collection-errors $TESTS ${TESTS_K:+-k "$TESTS_K"} -s > "$OUT/tests.log" 2>&1
  echo "pytest exit status $?"  # (0: every selected test passed; 124: stopped at TESTS_LIMIT, summary printed; 4/5: nothing collected)
  grep -E "passed|failed|error|worst|rel err|FAILED|Error" "$OUT/tests.log" | tail -20
fi
if [ "${LOOP:-0}" = 1 ]; then
  timeout 300 python3 benchmarks/engine_loop.py --model $CKPT --concurrency ${LOOP_C:-1,32,64} --warmup-s 4 --timed-s 6 ${LOOP_ARGS:-} --profile "$OUT/loop_profile.txt" 2>&1 | tee "$OUT/engine_loop.log" | grep -v "^{" | tail -9
fi
# LOOP_AB="a b": the engine alone again with each of these EngineConfig overrides (a, b: one
# or more --set FIELD=VALUE joined by '+'), no profile, same load
for ab in ${LOOP_AB:-}; do
  echo "engine_loop with ${ab//+/ }"
  timeout 150 python3 benchmarks/engine_loop.py --model $CKPT --concurrency ${LOOP_C:-1,32,64} --warmup-s 4 --timed-s 6 ${LOOP_ARGS:-} $(for kv in ${ab//+/ }; do echo --set $kv; done) 2>&1 | grep -v "^{" | tail -3
done
if [ "${SERVE:-0}" = 1 ]; then
  if [ -n "${PYSPY:-}" ]; then  # PYSPY="DELAY DURATION": attach DELAY s after the server is ready
    ( set +e; read -r delay dur <<< "$PYSPY"
      pid=$(python3 benchmarks/server_procs.py pid); sleep "$delay"
      /tmp/site/bin/py-spy record --pid "$pid" --subprocesses --threads --gil --rate 200 \
        --format raw --duration "$dur" -o "$OUT/pyspy.txt" > "$OUT/pyspy.log" 2>&1 ) &
  fi
  timeout 300 python3 benchmarks/serve_bench.py --model $CKPT --concurrency ${SERVE_C:-1,64} --requests ${SERVE_N:-0} --warmup -1 --starts 1 ${SERVE_MAX:+--max-num-seqs $SERVE_MAX} --out "$OUT/serve" 2>&1 | tail -6
  wait
  if [ -s "$OUT/pyspy.txt" ]; then
    python3 benchmarks/pyspy_top.py "$OUT/pyspy.txt" --top 20 > "$OUT/pyspy_top.txt" 2>&1; head -60 "$OUT/pyspy_top.txt"
  elif [ -n "${PYSPY:-}" ]; then tail -5 "$OUT/pyspy.log"
  fi
fi
if [ "${PROTOCOL:-0}" = 1 ]; then
  timeout ${PROTOCOL_LIMIT:-560} python3 benchmarks/serve_bench.py --model $CKPT --concurrency ${PROTOCOL_C:-1,32,64,128,256} --voices ${PROTOCOL_VOICES:-64cold} --timed-s ${PROTOCOL_S:-10} --warmup 64 --starts 3 --fresh-server --max-num-seqs 256 ${PROTOCOL_ARGS:-} --out "$OUT/protocol" > "$OUT/protocol.log" 2>&1
  grep -v -e "^[0-9]* voices C=" -e "^  C=" "$OUT/protocol.log" | tail -60
fi
# A call's first served run is the slow one: its start and warm-up compile the Triton kernels
# (H100, 2026-12-07: 83 against 62 s to ready; 125 s cut a first run that a second finished
# within). The first lever gets LEVER_FIRST_EXTRA more seconds.
extra=${LEVER_FIRST_EXTRA:-45}
for lever in ${LEVERS:-}; do
  name=${lever%%:*}; assigns=${lever#*:}
  limit=$((${LEVER_LIMIT:-200} + extra)); extra=0
  echo "lever $name: ${assigns//+/ }"
  if [ -n "${LEVER_DUMP:-}" ]; then  # "D1 D2 ...": py-spy dumps of every thread D s after ready
    timeout $((limit + 30)) python3 benchmarks/server_procs.py dump "$OUT/dump-$name.txt" $LEVER_DUMP &
  fi
  env ${assigns//+/ } timeout $limit python3 benchmarks/serve_bench.py --model $CKPT --concurrency ${LEVER_C:-128,256} --voices ${LEVER_VOICES:-64cold} --timed-s ${PROTOCOL_S:-10} --warmup 64 --starts ${LEVER_STARTS:-1} --fresh-server --max-num-seqs 256 ${LEVER_ARGS:-} --out "$OUT/lever-$name" > "$OUT/lever-$name.log" 2>&1
  grep -v "^[0-9]* voices C=" "$OUT/lever-$name.log" | tail -14
  wait  # the dumps, if any
done
for g in ${GIL_MS:-}; do
  CLONECAST_GIL_SWITCH_MS=$g timeout 150 python3 benchmarks/serve_bench.py --model $CKPT --concurrency 64,128 --requests 256 --warmup 64 --starts 1 --max-num-seqs 256 --out "$OUT/gil_$g" 2>&1 | grep "^default.* 1 " | sed "s/^/gil $g ms: /"
done
if [ "${HOST:-0}" = 1 ]; then
  for c in 64 128; do
    timeout 100 python3 benchmarks/host_cost.py --model $CKPT --concurrency $c --gc-tuned --steps 80 2>&1 | grep -v Warn | tail -17
  done
fi
# SCALE="1 2 noaff": which of the runs (one engine; two; two without affinity) this call does
for run in ${SCALE:-}; do
  case $run in
    1) devices=cuda:0; extra="" ;;
    2) devices=cuda:0,cuda:1; extra="" ;;
    noaff) devices=cuda:0,cuda:1; extra="CLONECAST_VOICE_AFFINITY=0" ;;
  esac
  env CLONECAST_DEVICES=$devices $extra timeout ${SCALE_LIMIT:-280} python3 benchmarks/serve_bench.py --model $CKPT --concurrency ${SCALE_C:-64,128,256,512} --timed-s ${SCALE_S:-10} --warmup 64 --starts 1 --max-num-seqs 256 --voices ${SCALE_VOICES:-64} --out "$OUT/scale-$run" > "$OUT/scale-$run.log" 2>&1
  tail -20 "$OUT/scale-$run.log"
done
if [ -f "$OUT/scale-1/serve_bench.json" ] && [ -f "$OUT/scale-2/serve_bench.json" ]; then
  noaff=""; [ -f "$OUT/scale-noaff/serve_bench.json" ] && noaff="--no-affinity $OUT/scale-noaff/serve_bench.json"
  python3 benchmarks/scaling_report.py "$OUT/scale-1/serve_bench.json" "$OUT/scale-2/serve_bench.json" $noaff | tee "$OUT/scaling.txt"
fi
if [ "${KILL:-0}" = 1 ]; then
  timeout 400 python3 benchmarks/engine_kill.py --serve-args "--devices cuda:0,cuda:1 --model $CKPT --max-num-seqs 256" --streams 64 --seconds 30 2>&1 | tee "$OUT/engine_kill.log" | tail -5
fi
if [ "${QUANT_ERR:-0}" = 1 ]; then
  timeout ${QUANT_ERR_LIMIT:-200} python3 benchmarks/quantization_error.py --ckpt $CKPT ${QUANT_ERR_ARGS:-} 2>&1 | tee "$OUT/quantization_error.log" | tail -8
fi
if [ "${STEP:-1}" = 1 ]; then
  timeout 200 python3 benchmarks/eager_step.py --ckpt $CKPT --profile "$OUT/profile.txt" ${STEP_ARGS:-} 2>&1 | tee "$OUT/eager_step.log" | tail -14
fi
for ab in ${BUCKETS:-}; do
  timeout 200 python3 benchmarks/bucket_cost.py --ckpt $CKPT $(for kv in ${ab//+/ }; do echo --set $kv; done) ${BUCKETS_ARGS:-} 2>&1 | tee "$OUT/bucket_cost-${ab//[^A-Za-z0-9_]/-}.log" | grep -v Warn | tail -20
done
# STEP_AB="a b": the decode step again with each override set (as LOOP_AB), no profile
for ab in ${STEP_AB:-}; do
  echo "eager_step with ${ab//+/ }"
  timeout 200 python3 benchmarks/eager_step.py --ckpt $CKPT ${STEP_ARGS:-} $(for kv in ${ab//+/ }; do echo --set $kv; done) 2>&1 | tail -4
done
