#!/usr/bin/env bash
# Find a Python >= 3.12, create/reuse .venv and install the project with its extras.
# Usage: source scripts/setup_env.sh   (sets $PY to the venv's python)
#
# With PYTHON=/path/to/python set, that interpreter is used as it is instead (an environment
# that already has CUDA torch, transformer-engine, megatron-core): no .venv, nothing
# installed. It is checked first, and refused with one line naming what it lacks: Python
# >= 3.12, the project's requirements (torch, megatron-core, numpy, packaging) and what the
# sourcing script adds in $SETUP_NEEDS (test.sh: pytest, hypothesis). The project itself is
# imported from this checkout (it goes first on PYTHONPATH).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv="$root/.venv"

if [ -n "${PYTHON:-}" ]; then
  if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
    echo "error: PYTHON=$PYTHON is not a Python >= 3.12 (unset PYTHON to use .venv/)" >&2
    exit 1
  fi
  # each argument: an import name, or import-name=pip-name for the message
  # shellcheck disable=SC2086
  missing=$("$PYTHON" -c '
import importlib.util, sys
missing = []
for spec in sys.argv[1:]:
    module, _, dist = spec.partition("=")
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent that does not import; a blocked module
        found = False
    if not found:
        missing.append(dist or module)
print(" ".join(missing))
' torch megatron.core=megatron-core numpy packaging ${SETUP_NEEDS:-})
  if [ -n "$missing" ]; then
    echo "error: PYTHON=$PYTHON lacks: $missing (install them there: $PYTHON -m pip install $missing; or unset PYTHON to use .venv/)" >&2
    exit 1
  fi
  PY=$PYTHON
  PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
  export PY PYTHONPATH
  echo "[setup] using PYTHON=$PYTHON as it is (no .venv/, nothing installed)" >&2
  return 0 2>/dev/null || exit 0
fi

find_python() {
  local c
  for c in python3.13 python3.12 \
    "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.13*/bin/python3 \
    "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3 \
    /usr/bin/python3 python3; do
    # A pyenv shim may exist on PATH without a usable interpreter behind it: run it.
    if "$c" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
      command -v "$c" 2>/dev/null || echo "$c"
      return 0
    fi
  done
  return 1
}

if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c 'import sys; sys.exit(sys.version_info < (3, 12))'; then
  base=$(find_python) || { echo "error: no Python >= 3.12 found (tried python3.13, python3.12, pyenv versions)" >&2; exit 1; }
  echo "[setup] creating $venv with $base" >&2
  rm -rf "$venv"
  "$base" -m venv "$venv"
fi
PY="$venv/bin/python"
stamp="$venv/.installed-$(sha1sum "$root/pyproject.toml" | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  echo "[setup] installing the project and its megatron/test/bench/dev extras (torch is ~5 GB the first time)" >&2
  "$PY" -m pip install -q --upgrade pip >&2
  "$PY" -m pip install -q -e "$root[megatron,test,bench,dev]" >&2
  touch "$stamp"
fi
export PY
