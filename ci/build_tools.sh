#!/usr/bin/env bash
# Compiles the lab tools under tools/ (CI runs none of them: they measure an H200 or an AMX host),
# so that a change to the kernel headers they include fails here rather than at the next
# measurement. Needs g++ and nvcc, as the wheel job does.
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(mktemp -d "${TMPDIR:-/tmp}/hmoe-tools.XXXXXX")
trap 'rm -rf "$out"' EXIT
bash tools/experts_tune/build.sh amx "$out/experts_tune"
g++ -O2 -std=c++17 -march=sapphirerapids tools/amx_tune/amx_peak.cpp -lpthread -o "$out/amx_peak"
g++ -O3 -std=c++17 -march=sapphirerapids -mamx-tile -mamx-int8 -mamx-bf16 -fopenmp tools/amx_tune/amx_tune.cpp \
  -o "$out/amx_tune"
nvcc -std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a -Icuda tools/wgmma_peak/wgmma_peak.cu -o "$out/wgmma_peak"
nvcc -std=c++17 -O3 -gencode arch=compute_90,code=sm_90 -Icuda tools/mma_peak/mma_peak.cu -o "$out/mma_peak"
nvcc -std=c++17 -O3 -gencode arch=compute_90,code=sm_90 -Icuda tools/read_peak/read_peak.cu -o "$out/read_peak"
echo "tools: experts_tune, amx_peak, amx_tune, wgmma_peak, mma_peak, read_peak compile"
