#!/usr/bin/env bash
# Builds tools/experts_tune for one ISA level of arch/cpu.json (default amx) into $2 (default
# /tmp/experts_tune), with the op's per-phase timing compiled in. Extra arguments go to g++
# (e.g. -DSOME_TUNING_MACRO=...).   usage: tools/experts_tune/build.sh [LEVEL] [OUT] [g++ flags...]
set -euo pipefail
cd "$(dirname "$0")/../.."
level=${1:-amx}; out=${2:-/tmp/experts_tune}; shift 2 || shift $#
flags=$(python3 -c "import json,sys; lv=[l for l in json.load(open('arch/cpu.json'))['processors']['x86_64']['levels'] if l['name']=='$level']; print(' '.join(lv[0]['flags']))")
g++ -O3 -std=c++17 -DNDEBUG $flags -DHMOE_ISA="$level" "-DHMOE_ISA_HEADER=\"experts/isa/$level.h\"" -DHMOE_PHASE_TIMING \
  -Icpp -Iinclude "$@" tools/experts_tune/experts_tune.cpp cpp/experts/moe_experts.cpp cpp/experts/pack.cpp \
  cpp/common/thread_pool.cpp -o "$out" -lpthread
echo "built $out ($level)"
