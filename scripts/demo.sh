#!/usr/bin/env bash
# The README's main-job command: set up the environment, then run the demo.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
source "$root/scripts/setup_env.sh"
cd "$root"
"$PY" -m buffers.demo "$@"
