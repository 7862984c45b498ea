#!/usr/bin/env bash
# Find a Python >= 3.12, create/reuse .venv and install the project with its extras.
# Usage: source scripts/setup_env.sh   (sets $PY to the venv's python)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv="$root/.venv"

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
  echo "[setup] installing the project and its test/bench extras (torch is ~5 GB the first time)" >&2
  "$PY" -m pip install -q --upgrade pip >&2
  "$PY" -m pip install -q -e "$root[test,bench,dev]" >&2
  touch "$stamp"
fi
export PY
