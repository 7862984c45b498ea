#!/usr/bin/env bash
# DeepSpeed for benchmarks/offload_scale.py's deepspeed row, into the ignored folder
# .whl/deepspeed/ (after scripts/fetch_gpu_wheels.sh, which empties .whl/). PyPI has only
# DeepSpeed's sdist: it is built here into a pure-Python wheel (DS_BUILD_OPS=0: no op
# compiled; DeepSpeedCPUAdam is compiled by torch's JIT loader with ninja and the host's
# C++ compiler on first use), its setup reading torch from PYTHON's environment; its
# dependencies the GPU machine lacks come as wheels for its Python 3.12 on x86_64.
# There: scripts/gpu_session.sh's scale step installs them into /tmp/ds-site.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
dest=.whl/deepspeed
rm -rf "$dest" && mkdir -p "$dest"
DS_BUILD_OPS=0 "$py" -m pip wheel -q --no-deps --no-build-isolation -w "$dest" \
  "deepspeed==${DEEPSPEED_VERSION:-0.19.8}"
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$dest" hjson py-cpuinfo pydantic pydantic-core \
  annotated-types typing-inspection typing-extensions msgpack ninja einops psutil
ls -l "$dest"
