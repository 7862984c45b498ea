#!/usr/bin/env bash
# The README's main-job command: set up the environment, show stock megatron-core's norm of a
# mixed bf16/fp32 list next to ours and fp64 (stock runs on a GPU only; its kernel bug needs
# transformer-engine), train the demo model with FlatGradBuffers, then run the norm/clip and
# memory benchmarks (CPU sizes without a GPU) and print their tables. Output files go to bench-out/ (override with OUT=...).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
source "$root/scripts/setup_env.sh"
cd "$root"
out=${OUT:-bench-out}  # the scripts' own default too; they hide megatron-core's known notices
echo "== the bug: the norm of a mixed bf16/fp32 gradient list, stock megatron-core vs ours"
# megatron-core's import notices (docs/megatron-core.md) are hidden, as the benchmarks hide them
"$PY" -W "ignore:Transformer Engine and Apex are not installed" \
    -W "ignore:absl.logging is not installed" -m megatron_ext.mixed_list_demo
echo
echo "== demo: a mixed bf16/fp32 model trained with FlatGradBuffers"
"$PY" -m buffers.demo "$@"
echo
echo "== benchmark: norm and clip, side by side (tables below; JSON and PNG in $out/)"
"$PY" benchmarks/norm_clip.py --out "$out"
echo
echo "== benchmark: gradient-buffer memory per rank"
"$PY" benchmarks/memory.py --out "$out"
