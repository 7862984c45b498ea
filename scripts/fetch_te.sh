#!/usr/bin/env bash
# Download transformer-engine (TE) for the GPU test machine into the ignored folder .te/.
# Run on a machine with network access, in any directory; see --help and docs/testing.md.
set -euo pipefail

usage() {
  cat <<'USAGE'
usage: bash scripts/fetch_te.sh [-h]

Downloads what the GPU test machine (no network; torch with CUDA 13, nvcc, Python 3.12)
needs to install transformer-engine, into the ignored folder .te/ of the repository:
  .te/deps/   the TE meta wheel, the TE torch-extension source (built on the GPU machine by
              scripts/install_te.sh), the pure-Python packages TE imports that the machine
              lacks, CORE_WHEEL (the core wheel's file name) and CORE_SHA256 (its checksum);
  .te/pN/part the CUDA-13 core wheel (about 276 MB for 2.20.2) cut into parts of at most
              TE_PART_MIB MiB, so that each part fits one transfer to the machine.
Then, on the GPU machine: bash scripts/install_te.sh --help.

environment:
  TE_VERSION   transformer-engine version (default: 2.20.2)
  TE_PART_MIB  size of each part of the core wheel in MiB (default: 56)
  PYTHON       the Python whose pip downloads (default: python3; any version: the
               downloads are for CPython 3.12 on x86-64 Linux whatever runs pip)
USAGE
}
for arg in "$@"; do
  case $arg in
    -h | --help) usage; exit 0 ;;
    *) echo "fetch_te.sh: unknown argument $arg (see --help)" >&2; exit 2 ;;
  esac
done

cd "$(dirname "${BASH_SOURCE[0]}")/.."
version=${TE_VERSION:-2.20.2}
part_mib=${TE_PART_MIB:-56}
py=${PYTHON:-python3}
# The GPU machine's interpreter and platform, not this one's.
target=(--only-binary=:all: --python-version 3.12 --implementation cp
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
# What TE 2.20's Python side imports beyond torch, numpy and packaging, pinned to the
# versions installed together on the GPU machine before.
python_deps=(pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0
  typing-inspection==0.4.5 typing-extensions==4.16.0 nvdlfw-inspect==0.2.2
  nvidia-cudnn-frontend==1.32.0)

rm -rf .te && mkdir -p .te/deps .te/core
"$py" -m pip download -q --no-deps "${target[@]}" -d .te/deps \
  "transformer-engine==$version" "${python_deps[@]}"
# The torch extension comes as source only: it is built against the GPU machine's torch.
"$py" -m pip download -q --no-deps -d .te/deps "transformer-engine-torch==$version"
"$py" -m pip download -q --no-deps "${target[@]}" -d .te/core "transformer-engine-cu13==$version"

wheels=(.te/core/*.whl)
[ ${#wheels[@]} -eq 1 ] || { echo "fetch_te.sh: expected one core wheel, got ${wheels[*]}" >&2; exit 1; }
core=${wheels[0]}
basename "$core" > .te/deps/CORE_WHEEL
sha256sum "$core" | cut -d' ' -f1 > .te/deps/CORE_SHA256
split -b "${part_mib}M" -d -a 1 "$core" .te/core/part
for piece in .te/core/part*; do
  n=${piece##*part}
  mkdir -p ".te/p$n" && mv "$piece" ".te/p$n/part"
done
rm -rf .te/core
du -sh .te/deps .te/p*
echo "parts: $(cd .te && ls -d p* | tr '\n' ' ')"
