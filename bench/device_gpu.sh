#!/usr/bin/env bash
# The GPU benchmark of issue 6 in one call of the workplace's device machine.
#
#   run(command="bash bench/device_gpu.sh", timeout_s=600)     # the device tool
#   OUT=/tmp/gpu BENCH_ARGS="--device cpu --dtype float32 --gammas 2 --max-new-tokens 8 --reps 1" \
#       bash bench/device_gpu.sh                              # a rehearsal on the CPU
#
# BENCH_ARGS are appended to the bench's own (a later option wins);
# HISTOGRAMS, BENCH_TIMEOUT_S (default 400), PROMPT_SETS (the --prompts of
# each run in turn), MESH_TIMEOUT_S (default 120), MESH_TARGET (7b) and
# PYTHON (python3) may be set.
#
# Every GPU is used: the script counts them (JAX's GPU devices, else
# nvidia-smi's list) and says how many it found. The bench runs on one
# (its figures are one device's); then `bench.tools.mesh_bench` runs one
# generation on a mesh of all of them (`jspec.mesh`: the target
# tensor-parallel, rows data-parallel; random weights of Qwen2.5-7B's
# shapes), with its tokens/s and whether its ids equal one GPU's, in
# $OUT/mesh_gpu.json. With one GPU that mesh is 1 x 1.
#
# That machine (an H200) has no network and takes 64 MiB of files, so the
# real weights cannot travel: jspec and HF transformers run on random weights
# of the real pair's shapes in bfloat16 (a round's cost depends on shapes, not
# values), and jspec's speculative tokens/s are derived from the accepted-length
# histograms the real pair gave on CPU (bench/derive.py; every such figure is
# labelled "derived"). Its Python has jax, flax, torch and transformers but
# neither gguf nor platformdirs, which this path does without, and nothing is
# installed: the checkout runs from PYTHONPATH.
#
# Everything lands in $OUT: the results JSON, its plots, the log and
# nvidia-smi's report. The bench writes its JSON after every prompt and
# mode; a run stopped at BENCH_TIMEOUT_S has what it measured finalized
# (ratios, derived figures, plots), so a cut run still brings results back.
# Then the engine's tests on tiny models run on the GPU ($TESTS, pytest's
# node ids; empty skips them; TESTS_TIMEOUT_S, default 150).
# Exit status: the bench's (0, or 1 for a greedy mismatch), or 3 for a run
# cut short and finalized (not timeout's 124, which the device tool reads as
# the whole call having run out of time), or 5 for a bench that passed and
# tests that did not.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:?set OUT to the folder for the results}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export JSPEC_CACHE=${JSPEC_CACHE:-/tmp/jspec_cache}
# JAX takes 75% of the GPU by default; the HF child needs room beside it.
# Allocated as needed, not all at the start: on the H200 (2026-12-04) the
# bench's process failed three times to allocate the whole 69.9 GiB pool
# while its first program compiled (bench/results/gpu_h200_attempt.log).
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.5}
export XLA_PYTHON_CLIENT_PREALLOCATE=${XLA_PYTHON_CLIENT_PREALLOCATE:-false}
# Each compile's seconds in the log, so a run cut short still says where its
# time went (there, the first program was still compiling after 5 minutes).
export JAX_LOG_COMPILES=${JAX_LOG_COMPILES:-1}
PY=${PYTHON:-python3}
JSON="$OUT/suite_gpu_random.json"
# The real pair's spec_g1..8 accepted-length histograms, measured on CPU.
HISTOGRAMS=${HISTOGRAMS:-bench/results/gamma_sweep_cpu.json}

{ nvidia-smi || true; "$PY" -c "import jax, torch, transformers; print('jax', jax.__version__, \
jax.devices(), 'torch', torch.__version__, torch.cuda.is_available(), 'transformers', \
transformers.__version__)"; } > "$OUT/machine.txt" 2>&1

# How many GPUs: JAX's count, or nvidia-smi's list where JAX finds no GPU backend.
gpu_count() {
  local n
  n=$("$PY" -c "import jax; print(len(jax.devices('gpu')))" 2>/dev/null) && { echo "$n"; return; }
  n=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ') || true
  echo "${n:-0}"
}
GPUS=$(gpu_count)
echo "device_gpu: found $GPUS GPU(s)" | tee -a "$OUT/log.txt" "$OUT/machine.txt"

# The histogram file's prompts one at a time, gammas 1..8, each run resuming
# the last (`--resume` measures only what is missing, the HF peers included),
# so the first prompt is complete, HF and all, before a second one starts.
# Time on the GPU is not yet known (the layers unroll there, so compiling
# may take most of it); the runs stop at BENCH_TIMEOUT_S in all.
budget=${BENCH_TIMEOUT_S:-400}
status=0
for prompts in ${PROMPT_SETS:-quicksort quicksort,js_debounce quicksort,js_debounce,unit_tests}; do
  left=$((budget - SECONDS))
  if [ "$left" -lt 60 ]; then
    echo "device_gpu: ${left}s left, not starting --prompts $prompts" | tee -a "$OUT/log.txt"
    break
  fi
  timeout --signal=INT --kill-after=20 "$left" \
    "$PY" -m bench --random-weights --dtype bfloat16 --device gpu --histograms "$HISTOGRAMS" \
      --prompts "$prompts" --gammas 1,2,3,4,5,6,7,8 --reps 3 --max-new-tokens 128 \
      --resume --out "$JSON" ${BENCH_ARGS:-} 2>&1 | tee -a "$OUT/log.txt"
  status=${PIPESTATUS[0]}
  echo "device_gpu: --prompts $prompts: bench exit status $status after ${SECONDS}s" \
    | tee -a "$OUT/log.txt"
  [ "$status" = 0 ] || break
done

# A run cut short left its records but no ratios, derived figures or plots.
if [ "$status" != 0 ] && [ "$status" != 1 ]; then
  "$PY" -m bench.finalize "$JSON" --histograms "$HISTOGRAMS" 2>&1 | tee -a "$OUT/log.txt"
fi

# One generation on a mesh of every GPU found (1 x 1 with one GPU).
if [ "$GPUS" -ge 1 ]; then
  timeout --signal=INT --kill-after=20 "${MESH_TIMEOUT_S:-120}" \
    "$PY" -m bench.tools.mesh_bench --target "${MESH_TARGET:-7b}" --devices "$GPUS" \
      --out "$OUT/mesh_gpu.json" 2>&1 | tee -a "$OUT/log.txt"
  echo "device_gpu: mesh of $GPUS GPU(s): exit status ${PIPESTATUS[0]}" | tee -a "$OUT/log.txt"
else
  echo "device_gpu: no GPU found; no mesh run" | tee -a "$OUT/log.txt"
fi
# The engine's greedy-equality and lossless tests and the one-device mesh
# tests, on tiny models, on this machine's default device (the GPU). fp32
# dots at full precision (JAX's GPU default is TF32, which HF's fp32
# reference does not use); the shipped XLA flags, not the suite's CPU
# compile-time ones. Their lines go to the log; a failure makes the exit 5.
TESTS=${TESTS-tests/test_engine.py::test_greedy_speculative_equals_target \
tests/test_engine.py::test_batch_rows_equal_their_single_runs tests/test_lossless.py \
tests/test_speculative.py tests/test_mesh.py::test_a_mesh_of_one_device_runs_in_process \
tests/test_mesh.py::test_greedy_every_method_equals_one_device[1x1]}
read -r -a test_ids <<< "$TESTS"  # no globbing of the [1x1] in a node id
tests_status=0
if [ "${#test_ids[@]}" -gt 0 ]; then
  JSPEC_TEST_XLA_OPT=1 JAX_DEFAULT_MATMUL_PRECISION=highest JAX_LOG_COMPILES=0 \
    timeout --signal=INT --kill-after=20 "${TESTS_TIMEOUT_S:-150}" \
    "$PY" -m pytest -v -p no:cacheprovider -n "${TEST_WORKERS:-8}" "${test_ids[@]}" 2>&1 | tee -a "$OUT/log.txt"
  tests_status=${PIPESTATUS[0]}
  echo "device_gpu: tests on $("$PY" -c 'import jax; print(jax.default_backend())' 2>/dev/null): \
exit status $tests_status after ${SECONDS}s" | tee -a "$OUT/log.txt"
fi
[ "$status" = 124 ] && exit 3
[ "$status" = 0 ] && [ "$tests_status" != 0 ] && exit 5
exit "$status"
