#!/usr/bin/env bash
# Run the CPU tests that depend most on torch's internals against another torch release.
#
# Usage: bash scripts/torch_matrix.sh [VERSION ...] [-- PYTEST_ARGS]
#   VERSION   a torch release on PyPI. Default: $TORCH_MATRIX_VERSIONS, else "2.11.0" (the
#             oldest pyproject.toml claims; .venv holds the newest pip installs here).
#   TORCH_MATRIX_TESTS  the tests to run (default: megatron-core's DDP and distributed
#                       optimizer on the CPU shim, whose collectives torch 2.11 dispatches
#                       differently; our collectives under gloo; the fused ops).
#
# Each release is installed once into .torch/<version>/ with `pip install --no-deps --target`
# (the rest, megatron-core and the CUDA libraries torch loads, come from .venv), reused while
# its stamp file .torch/<version>/.complete is there, and put first on PYTHONPATH. Before the
# tests a check says which torch imports, and fails when it is not the intended one.
# Logs: .torch/logs/<version>.log. Exit status 1 when a version fails.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
case " $* " in *" -h "*|*" --help "*) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;; esac
if [ -z "${PY:-}" ]; then
  source "$root/scripts/setup_env.sh" # sets $PY
fi
cd "$root"

versions=()
pytest_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --) shift; pytest_args=("$@"); break ;;
    -*) echo "error: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) versions+=("$1") ;;
  esac
  shift
done
if [ ${#versions[@]} -eq 0 ]; then
  read -r -a versions <<<"${TORCH_MATRIX_VERSIONS:-2.11.0}"
fi
default_tests="tests/test_megatron_cpu.py::test_ddp_and_distributed_optimizer_on_cpu"
default_tests+=" tests/test_megatron_cpu.py::test_the_shim_records_each_collective_once_whichever_way_torch_dispatches_it"
default_tests+=" tests/test_distributed.py tests/test_ops.py"
read -r -a tests <<<"${TORCH_MATRIX_TESTS:-$default_tests}"

mkdir -p .torch/logs
status=0
summary=()
for v in "${versions[@]}"; do
  dir="$root/.torch/$v"
  echo
  echo "== torch $v: ${tests[*]}"
  if [ ! -f "$dir/.complete" ]; then
    echo "[torch-matrix] installing torch==$v into .torch/$v (no deps; the rest stays .venv's)"
    rm -rf "$dir"
    "$PY" -m pip install -q --disable-pip-version-check --no-deps --target "$dir" "torch==$v"
    echo "$v" >"$dir/.complete"
  fi
  log=".torch/logs/$v.log"
  rm -f "$log"
  rc=0
  PYTHONPATH="$dir${PYTHONPATH:+:$PYTHONPATH}" "$PY" - "$v" "$dir" <<'EOF' || rc=$?
import sys
import torch
want, where = sys.argv[1], sys.argv[2]
got = torch.__version__.split("+")[0]
print(f"[torch-matrix] torch {torch.__version__} from {torch.__file__}")
if got != want or not torch.__file__.startswith(where):
    sys.exit(f"[torch-matrix] error: wanted torch {want} from {where}")
EOF
  if [ $rc -eq 0 ]; then
    PYTHONPATH="$dir${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m pytest -q -rfEs -p no:cacheprovider \
      "${tests[@]}" "${pytest_args[@]}" 2>&1 | tee "$log" || rc=$? # pipefail: pytest's status
  fi
  last=$({ grep -v "^[[:space:]]*$" "$log" 2>/dev/null || true; } | tail -n 1 | sed 's/^=* *//; s/ *=*$//')
  if [ $rc -eq 0 ]; then summary+=("  torch $v: PASS  $last"); else summary+=("  torch $v: FAIL  $last"); status=1; fi
done
echo
echo "== torch matrix (logs in .torch/logs/)"
printf '%s\n' "${summary[@]}"
exit $status
