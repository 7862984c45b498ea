#!/usr/bin/env bash
# The README's main-job command: set up the environment, show stock megatron-core's norm of a
# mixed bf16/fp32 list next to ours and fp64 (stock runs on a GPU only; its kernel bug needs
# transformer-engine), train the demo model with FlatGradBuffers, then run the norm/clip and
# memory benchmarks (CPU sizes without a GPU) and print their tables. Output files go to bench-out/ (override with OUT=...).
set -euo pipefail
usage() {
  cat <<'USAGE'
usage: bash scripts/main.sh [-h] [--steps STEPS] [--device DEVICE] [--max-norm MAX_NORM]

The main job. It finds a Python >= 3.12, creates or reuses .venv/ and installs the project
(torch, about 5 GB, the first time), then runs, printing each part's output:
  1. python -m megatron_ext.mixed_list_demo: the norm of a mixed bf16/fp32 gradient list from
     stock megatron-core (on a GPU only), from this library and in fp64;
  2. python -m buffers.demo: a small mixed bf16/fp32 model trained with FlatGradBuffers;
  3. benchmarks/norm_clip.py and benchmarks/memory.py (small sizes on the CPU, about a minute;
     real sizes on a GPU), with their tables.

options (passed to python -m buffers.demo):
  -h, --help           show this help and exit, running nothing
  --steps STEPS        training steps of the demo (default: 5)
  --device DEVICE      cpu or cuda (default: cuda when torch sees a GPU, else cpu)
  --max-norm MAX_NORM  clip the total gradient norm to this value every step (default: 1.0)

files: the benchmarks' JSON, PNG and full tables (.txt) go to bench-out/, or to $OUT when set.
USAGE
}
for arg in "$@"; do
  case $arg in -h | --help) usage; exit 0 ;; esac
done
fail() { # a usage error: this script's usage, then the problem, before anything runs
  usage >&2
  echo "bash scripts/main.sh: error: $1" >&2
  exit 2
}
# Option names first, before the set-up (which may download torch) and before any part runs.
expect_value=
for arg in "$@"; do
  if [ -n "$expect_value" ]; then expect_value=; continue; fi
  case $arg in
    --steps=* | --device=* | --max-norm=*) ;;
    --steps | --device | --max-norm) expect_value=$arg ;;
    *) fail "unrecognized argument: $arg" ;;
  esac
done
[ -z "$expect_value" ] || fail "argument $expect_value: expected one value"
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
source "$root/scripts/setup_env.sh"
cd "$root"
# Then their values, with the demo's own checks, named as this script's.
"$PY" - "$@" <<'CHECK' || exit 2
import sys

from buffers import demo

parser = demo.build_parser()
parser.prog = "bash scripts/main.sh"
args = parser.parse_args(sys.argv[1:])
problem = demo._device_problem(args.device)
if problem is not None:
    parser.error(f"argument --device: {problem}")
CHECK
out=${OUT:-bench-out}  # the scripts' own default too; they hide megatron-core's known notices
echo "== the bug: the norm of a mixed bf16/fp32 gradient list, stock megatron-core vs ours"
"$PY" -m megatron_ext.mixed_list_demo  # megatron_ext hides megatron-core's import notices
echo
echo "== demo: a mixed bf16/fp32 model trained with FlatGradBuffers"
"$PY" -m buffers.demo "$@"
echo
echo "== benchmark: norm and clip, side by side (summary below; full table, JSON and PNG in $out/)"
"$PY" benchmarks/norm_clip.py --out "$out"
echo
echo "== benchmark: gradient-buffer memory per rank"
"$PY" benchmarks/memory.py --out "$out"
