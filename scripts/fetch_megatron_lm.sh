#!/usr/bin/env bash
# Bring Megatron-LM's launch scripts (pretrain_gpt.py and the two modules it imports), which
# the megatron-core wheel lacks, into the ignored folder .megatron-lm/ (never committed).
# Usage: scripts/fetch_megatron_lm.sh [SOURCE]
#   SOURCE: a Megatron-LM git directory (a clone, or a bare mirror) or a clone URL;
#           default $MEGATRON_LM_GIT, else https://github.com/NVIDIA/Megatron-LM.git
#   MEGATRON_LM_REF: the tag matching your megatron-core (default core_v0.19.0 for 0.19.x)
# Then: export MEGATRON_LM_PATH=$PWD/.megatron-lm
set -euo pipefail
cd "$(dirname "$0")/.."
src=${1:-${MEGATRON_LM_GIT:-https://github.com/NVIDIA/Megatron-LM.git}}
ref=${MEGATRON_LM_REF:-core_v0.19.0}
files=(pretrain_gpt.py gpt_builders.py model_provider.py LICENSE)
dest=.megatron-lm
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
if [ -d "$src" ]; then
  gitdir=$(cd "$src" && cd "$(git rev-parse --git-dir)" && pwd)
else
  git clone -q --bare --depth 1 --branch "$ref" "$src" "$tmp/repo.git"
  gitdir=$tmp/repo.git
fi
git --git-dir="$gitdir" archive --format=tar "$ref" "${files[@]}" | tar -x -C "$tmp"
rm -rf "$dest" && mkdir -p "$dest"
cp "${files[@]/#/$tmp/}" "$dest/"
echo "$ref $(git --git-dir="$gitdir" rev-parse "$ref^{commit}")" > "$dest/REF"
echo "Megatron-LM $ref -> $dest: ${files[*]}"
echo "export MEGATRON_LM_PATH=$PWD/$dest"
