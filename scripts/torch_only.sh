#!/usr/bin/env bash
# The torch-only install: what a plain-PyTorch user gets from `pip install
# megatron-dtype-buffers` (no megatron-core extra), on the oldest Python pyproject.toml
# claims (3.11).
#
# Usage: bash scripts/torch_only.sh [-- PYTEST_ARGS]
#   TORCH_ONLY_PYTHON  the interpreter to build the environment from (default: python3.11 on
#                      PATH, else one under pyenv's versions/3.11*).
#
# Creates (or reuses, while pyproject.toml is unchanged) .venv-torch-only/ and installs the
# project into it from this checkout, not editable, with the test and bench extras only.
# Then, in order, each failing the run: megatron-core must not be importable there; the
# installed copy (not this checkout) must train a mixed bf16/fp32 model with FlatGradBuffers
# from a folder outside the repository; `import megatron_ext` must refuse in one line naming
# what it needs; and the test files that touch nothing of megatron-core (scripts/
# mcore_matrix_tests.py --unmarked) must pass.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
case " $* " in *" -h "*|*" --help "*) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;; esac
pytest_args=()
if [ $# -gt 0 ]; then
  if [ "$1" != "--" ]; then echo "error: unknown argument $1 (see --help)" >&2; exit 2; fi
  shift
  pytest_args=("$@")
fi
cd "$root"

find_python() {
  local c
  for c in "${TORCH_ONLY_PYTHON:-}" python3.11 "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.11*/bin/python3 python3; do
    [ -n "$c" ] || continue
    if "$c" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' 2>/dev/null; then
      command -v "$c" 2>/dev/null || echo "$c"
      return 0
    fi
  done
  return 1
}

venv="$root/.venv-torch-only"
stamp="$venv/.installed-$(sha1sum pyproject.toml | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  base=$(find_python) || {
    echo "error: no Python 3.11 found (tried \$TORCH_ONLY_PYTHON, python3.11, python3, pyenv's 3.11*)" >&2
    exit 1
  }
  echo "[torch-only] creating .venv-torch-only with $base; installing the project with [test,bench] only"
  rm -rf "$venv"
  "$base" -m venv "$venv"
  # from a copy of what the package ships: a build in this checkout would leave build/ here
  src=$(mktemp -d)
  cp -r pyproject.toml README.md buffers megatron_ext "$src/"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check "$src[test,bench]"
  rm -rf "$src"
  touch "$stamp"
fi
PY="$venv/bin/python"
"$PY" -c 'import sys, torch; print(f"[torch-only] Python {sys.version.split()[0]}, torch {torch.__version__}")'

if "$PY" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("megatron") is None)'; then
  echo "error: megatron is importable in .venv-torch-only: the torch-only install pulled it in" >&2
  exit 1
fi

outside=$(mktemp -d)
trap 'rm -rf "$outside"' EXIT
(
  cd "$outside"
  "$PY" - "$root" <<'PY'
import sys
from pathlib import Path

import torch

import buffers
from buffers import FlatGradBuffers

root = Path(sys.argv[1])
where = Path(buffers.__file__).resolve()
installed = where.is_relative_to(Path(sys.prefix)) and not where.is_relative_to(root / "buffers")
assert installed, f"buffers imported from the checkout, not the install: {where}"
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 64, dtype=torch.bfloat16))
model.register_parameter("sink", torch.nn.Parameter(torch.zeros(64)))
fgb = FlatGradBuffers(model.named_parameters())
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    fgb.zero_()
    loss = model(torch.randn(8, 64, dtype=torch.bfloat16)).float().sum() + model.sink.sum()
    loss.backward()
    want = torch.linalg.vector_norm(
        torch.cat([p.grad.double().flatten() for p in model.parameters()])
    )
    norm = fgb.clip_grad_norm_(1.0)
    assert abs(norm.double() - want) <= 1e-6 * want, (float(norm), float(want))
    opt.step()
print(f"[torch-only] the installed buffers ({where.parent}) trained 3 steps, norms within 1e-6 of fp64")
PY
  if err=$("$PY" -c 'import megatron_ext' 2>&1); then
    echo "error: import megatron_ext succeeded without megatron-core" >&2
    exit 1
  fi
  last=$(tail -n 1 <<<"$err")
  case "$last" in
    *"MissingRequirementError: megatron_ext needs"*) echo "[torch-only] import megatron_ext refused: ${last#*: }" ;;
    *) echo "error: import megatron_ext failed without saying what it needs: $last" >&2; exit 1 ;;
  esac
)

mapfile -t tests < <("$PY" scripts/mcore_matrix_tests.py --unmarked)
echo "[torch-only] ${#tests[@]} test files that touch nothing of megatron-core"
"$PY" -m pytest -q -p no:cacheprovider "${tests[@]}" "${pytest_args[@]}"
