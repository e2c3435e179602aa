#!/usr/bin/env bash
# One device call's worth of experts tuning: builds the amx harness with each variant's macros
# (in parallel) and runs every variant on the prefill and decode shapes of the bench.
#   usage: tools/experts_tune/sweep.sh "NAME:-DMACRO=V -DMACRO2=V" ...
set -uo pipefail
cd "$(dirname "$0")/../.."
i=0; names=()
for v in "base:" "$@"; do
  name=${v%%:*}; flags=${v#*:}; names+=("$name")
  # shellcheck disable=SC2086
  bash tools/experts_tune/build.sh amx "/tmp/et_$i" $flags > /tmp/et_build_$i.log 2>&1 &
  i=$((i + 1))
done
wait
for j in $(seq 0 $((i - 1))); do
  echo "== ${names[$j]}"
  for f in int8 int4 bf16; do
    /tmp/et_$j $f 7168 2048 32 8 512 3
    /tmp/et_$j $f 2048 1408 64 6 512 3
  done
  for f in int4 int8; do /tmp/et_$j $f 7168 2048 32 8 1 9; /tmp/et_$j $f 2048 1408 64 6 1 9; done
done
