#!/usr/bin/env bash
# The README's test command: set up the environment, then run the CPU test suite, printing
# its 25 slowest tests (set-up, call and tear-down apart) so that a slow one stays visible.
# PYTHON=/path/to/python uses that interpreter as it is (scripts/setup_env.sh).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
SETUP_NEEDS="pytest hypothesis" # checked in an environment named by PYTHON=
source "$root/scripts/setup_env.sh"
cd "$root"
"$PY" -m pytest -q --durations=25 "$@"
