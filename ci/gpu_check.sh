#!/usr/bin/env bash
# On a GPU machine: build and install hmoe (every CUDA target), run the whole test suite
# (GPU tests included), the compat check with self-tests and the benchmarks (host overhead, MLA
# decode, CPU experts, a whole model end to end), writing logs to
# the folder given as $1. flashinfer wheels in .device/whl/ (../shared/device/fetch-wheels.sh)
# are installed first when present, for the mla comparison.
#   usage: bash ci/gpu_check.sh OUTDIR [experts-bench args...]
# HMOE_GPU_STEPS="build tests_gpu" runs only those steps (default: build tests_gpu tests
# tests_compat compat bench_overhead bench_mla bench_experts bench_e2e), so that the work fits the
# device tool's 10-minute calls: each test step with a build fits one on an H200 host (tests_gpu,
# the tests marked gpu, 243 s; tests, the rest but tests/compat, 263 s; tests_compat 340 s, where
# each hmoe.compat child initialises NVML and imports a CUDA torch, against 78 s on a 2-core
# machine without a GPU). PYTEST_ADDOPTS passes pytest's own options (a -k, a -x) to all three.
# They print a line a test, so that a log cut short still names what ran and failed.
set -uo pipefail
out=${1:?usage: ci/gpu_check.sh OUTDIR}
shift || true
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
status=0

all_steps="build tests_gpu tests tests_compat compat bench_overhead bench_mla bench_experts bench_e2e"
steps=" ${HMOE_GPU_STEPS:-$all_steps} "
step() {  # step NAME CMD...: runs CMD, tees its log, remembers a failure
  local name=$1; shift
  [[ $steps == *" $name "* ]] || return 0
  echo "=== $name: $*"
  local t0=$SECONDS
  "$@" > "$out/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$out/$name.log"
  echo "=== $name: exit $rc after $((SECONDS - t0)) s"
  [ $rc -eq 0 ] || status=1
  return $rc
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$out/gpu.txt" 2>&1; cat "$out/gpu.txt"
lscpu | grep -E "Model name|^CPU\(s\)|Flags" | cut -c1-200 > "$out/cpu.txt"; cat "$out/cpu.txt"

if ls .device/whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .device/whl/*.whl && export PYTHONPATH=/tmp/site
fi

# A fresh build folder: on a machine kept warm between calls, a build/ left by other sources can
# look newer than the sources copied in (ninja compares times) and install stale objects.
[[ $steps == *" build "* ]] && rm -rf build
step build env HMOE_CUDA=ON CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
  python3 -m pip install --no-build-isolation --no-deps -v . || { echo "build failed"; exit 1; }
step tests_gpu python3 -m pytest tests -m gpu -v -rs -p no:cacheprovider
step tests python3 -m pytest tests -m "not gpu" --ignore=tests/compat -v -rs -p no:cacheprovider
step tests_compat python3 -m pytest tests/compat -m "not gpu" -v -rs -p no:cacheprovider
step compat python3 -m hmoe.compat check --selftest
step bench_overhead python3 -m hmoe.bench overhead --json "$out/bench_overhead.json"
step bench_mla python3 -m hmoe.bench mla --json "$out/bench_mla.json" --plot "$out/mla_roofline.png"
step bench_experts python3 -m hmoe.bench experts --json "$out/bench_experts.json" "$@"
step bench_e2e python3 -m hmoe.bench e2e --json "$out/bench_e2e.json"
exit $status
