#!/usr/bin/env bash
# The README's test command: set up the environment, then run the CPU test suite.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
source "$root/scripts/setup_env.sh"
cd "$root"
"$PY" -m pytest -q "$@"
