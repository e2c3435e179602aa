#!/usr/bin/env bash
# A/B of two source trees of hmoe on one machine: builds this tree ("this") and OTHER ("other", a
# source tree such as `mkdir -p .device/ab/other && git archive REV | tar -x -C .device/ab/other`,
# made before a device call and carried to it), each from a fresh build folder into its own
# folder, then runs CMD with each build first on PYTHONPATH, alternating, ROUNDS times. Two
# kernels' times compare only within one machine and card: on the shared GPU hosts the spread
# from run to run is larger than most single steps.
#   usage: tools/ab_build.sh OTHER [ROUNDS] -- CMD...
#   e.g.   HMOE_CUDA=ON HMOE_CUDA_ARCHS=90 tools/ab_build.sh .device/ab/other 2 -- \
#            python3 -m hmoe.bench mla --shapes 64x4096x128
# The builds' settings (HMOE_CUDA, HMOE_CUDA_ARCHS, CMAKE_BUILD_PARALLEL_LEVEL) pass through from
# the environment; AB_DIR (default /tmp/hmoe_ab) receives the two installs and their build logs.
set -uo pipefail
usage() { echo "usage: tools/ab_build.sh OTHER [ROUNDS] -- CMD..." >&2; exit 2; }
[ $# -ge 3 ] || usage
other=$1; shift
rounds=2
if [ "$1" != "--" ]; then rounds=$1; shift; fi
[ "${1:-}" = "--" ] || usage
shift
[ $# -ge 1 ] || usage
[[ $rounds =~ ^[1-9][0-9]*$ ]] || { echo "ab_build: ROUNDS must be a positive integer, got '$rounds'" >&2; exit 2; }
[ -f "$other/pyproject.toml" ] || { echo "ab_build: $other is not an hmoe source tree (no pyproject.toml)" >&2; exit 2; }
here=$(cd "$(dirname "$0")/.." && pwd)
other=$(cd "$other" && pwd)
ab=${AB_DIR:-/tmp/hmoe_ab}
mkdir -p "$ab"

build() {  # build NAME SOURCE
  local name=$1 src=$2 t0=$SECONDS
  rm -rf "$ab/$name" "$src/build"  # a build/ left by other sources can look newer than these
  echo "=== ab_build: building $name ($src)"
  if ! (cd "$src" && python3 -m pip install --no-build-isolation --no-deps -q --target "$ab/$name" .) \
      > "$ab/$name.log" 2>&1; then
    tail -n 30 "$ab/$name.log"
    echo "ab_build: the build of $name failed (log: $ab/$name.log)" >&2
    exit 1
  fi
  echo "=== ab_build: $name built in $((SECONDS - t0)) s"
}
build this "$here"
build other "$other"

status=0
for ((r = 1; r <= rounds; r++)); do
  for name in this other; do
    echo "=== ab_build: $name, round $r of $rounds: $*"
    PYTHONPATH="$ab/$name${PYTHONPATH:+:$PYTHONPATH}" "$@" || status=1
  done
done
exit $status
