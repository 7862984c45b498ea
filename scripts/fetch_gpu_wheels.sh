#!/usr/bin/env bash
# Download the wheels the GPU test machine lacks (it has torch, Triton, numpy, pytest and
# hypothesis, but no megatron-core and no network) into the ignored folder .whl/.
# There: pip install --no-index --no-deps --target /tmp/site .whl/*.whl; PYTHONPATH=/tmp/site
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
rm -rf .whl && mkdir -p .whl
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl "megatron-core==${MCORE_VERSION:-0.19.2}"
ls -l .whl
