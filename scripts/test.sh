#!/usr/bin/env bash
# The README's test command: set up the environment, then run the CPU test suite, printing
# its 25 slowest tests (set-up, call and tear-down apart) so that a slow one stays visible.
# PYTHON=/path/to/python uses that interpreter as it is (scripts/setup_env.sh).
#
# The tests run in pytest-xdist worker processes (scripts/test_workers.sh: one per core up to
# 4; TEST_WORKERS=N sets their number, 0 runs every test in pytest's own process, in file
# order). Arguments go to pytest after these options, so `-n 0` there wins too.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
SETUP_NEEDS="pytest hypothesis xdist=pytest-xdist" # checked in an environment named by PYTHON=
source "$root/scripts/setup_env.sh"
cd "$root"
workers=$(bash "$root/scripts/test_workers.sh")
"$PY" -m pytest -q --durations=25 -n "$workers" "$@"
