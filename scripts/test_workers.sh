#!/usr/bin/env bash
# Print how many pytest-xdist worker processes the test scripts use (scripts/test.sh,
# scripts/mcore_matrix.sh): TEST_WORKERS when set (0: none, every test in pytest's own
# process, in file order), else one per core up to 4 (on 2 cores the suite took 6 minutes
# where one process took 10; more workers than cores made it slower). Exit 2 when
# TEST_WORKERS is not a whole number.
set -euo pipefail
if [ -n "${TEST_WORKERS:-}" ]; then
  if ! [[ $TEST_WORKERS =~ ^[0-9]+$ ]]; then
    echo "error: TEST_WORKERS=$TEST_WORKERS is not a number of worker processes (0: none)" >&2
    exit 2
  fi
  echo "$TEST_WORKERS"
  exit 0
fi
cores=$(nproc 2>/dev/null || echo 1)
echo $((cores < 4 ? cores : 4))
