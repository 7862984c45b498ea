#!/usr/bin/env bash
# Install transformer-engine (TE) on the GPU test machine from what scripts/fetch_te.sh put in
# .te/; see --help and docs/testing.md.
set -euo pipefail

usage() {
  cat <<'USAGE'
usage: bash scripts/install_te.sh [-h] [--dry-run] [stash]

Run on the GPU test machine, in the repository root, after bash scripts/fetch_te.sh has
filled .te/ on a networked machine.

  stash      copy every part present here (.te/pN/part) to $TE_STASH/pN, and stop. The
             core wheel's parts may arrive one per transfer: stash each as it comes.
  (default)  stash the parts present here, join all stashed parts into the core wheel and
             check it against .te/deps/CORE_SHA256 (an incomplete set is refused, naming
             the parts stashed), install TE's pure-Python dependencies, build TE's torch
             extension against this machine's torch (about 2 minutes on 16 cores; once
             per machine: skipped while $TE_BUILD/done exists), and install the core wheel,
             the meta wheel and the extension together into $TE_SITE. Then put $TE_SITE
             first on PYTHONPATH.
  --dry-run  stash, join and check the wheel as above, then print the install and build
             commands instead of running them (no CUDA, torch or network needed).

environment:
  TE_STASH  where parts wait between transfers (default: /tmp/te-parts)
  TE_SITE   the pip --target folder (default: /tmp/site, where scripts/gpu_session.sh
            installs megatron-core)
  TE_BUILD  where the extension is built (default: /tmp/te-ext)
  PYTHON    the interpreter to install for (default: python3)
USAGE
}
mode=install
dry_run=0
for arg in "$@"; do
  case $arg in
    -h | --help) usage; exit 0 ;;
    --dry-run) dry_run=1 ;;
    stash) mode=stash ;;
    *) echo "install_te.sh: unknown argument $arg (see --help)" >&2; exit 2 ;;
  esac
done

cd "$(dirname "${BASH_SOURCE[0]}")/.."
stash=${TE_STASH:-/tmp/te-parts}
site=${TE_SITE:-/tmp/site}
build=${TE_BUILD:-/tmp/te-ext}
py=${PYTHON:-python3}
deps=.te/deps

mkdir -p "$stash"
for part in .te/p*/part; do
  [ -f "$part" ] || continue
  n=${part#.te/p}; n=${n%/part}
  cp "$part" "$stash/p$n"
  echo "stashed p$n in $stash"
done
have=$(cd "$stash" && ls p* 2>/dev/null | sort -V | tr '\n' ' ' || true)
[ "$mode" = stash ] && { echo "stashed so far: ${have:-none}"; exit 0; }

for f in CORE_WHEEL CORE_SHA256; do
  [ -f "$deps/$f" ] || { echo "install_te.sh: $deps/$f missing: bring .te/deps from scripts/fetch_te.sh" >&2; exit 1; }
done
wheel=$stash/$(cat "$deps/CORE_WHEEL")
mapfile -t parts < <(ls "$stash"/p* 2>/dev/null | sort -V)
[ ${#parts[@]} -gt 0 ] || { echo "install_te.sh: no part stashed in $stash: stash .te/p0 ... first" >&2; exit 1; }
cat "${parts[@]}" > "$wheel"
if [ "$(sha256sum "$wheel" | cut -d' ' -f1)" != "$(cat "$deps/CORE_SHA256")" ]; then
  rm -f "$wheel"
  echo "install_te.sh: the stashed parts ($have) do not make the core wheel (checksum differs): stash every part of .te/p0 ... first" >&2
  exit 1
fi
echo "core wheel $(basename "$wheel"): checksum matches (parts $have)"

run() {  # the command, or with --dry-run its words
  if [ $dry_run = 1 ]; then echo "would run: $*"; else "$@"; fi
}
install=("$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site")
run "${install[@]}" --upgrade "$deps"/pydantic*.whl "$deps"/annotated_types*.whl \
  "$deps"/typing_*.whl "$deps"/nvdlfw_inspect*.whl "$deps"/nvidia_cudnn_frontend*.whl
export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
sdists=("$deps"/transformer_engine_torch-*.tar.gz)
if [ ! -f "$build/done" ]; then
  run rm -rf "$build"
  run mkdir -p "$build/src" "$build/wheel"
  run tar xzf "${sdists[0]}" -C "$build/src"
  if [ $dry_run = 1 ]; then
    echo "would run: (cd $build/src/transformer_engine_torch-* && NVTE_PYTORCH_FORCE_BUILD=TRUE" \
      "MAX_JOBS=$(nproc) $py -m pip wheel -q --no-build-isolation --no-deps --no-index ." \
      "-w $build/wheel) > $build/build.log"
  else
    # against this machine's torch, hence no build isolation
    (cd "$build"/src/transformer_engine_torch-* && NVTE_PYTORCH_FORCE_BUILD=TRUE \
      MAX_JOBS=$(nproc) "$py" -m pip wheel -q --no-build-isolation --no-deps --no-index . \
      -w "$build/wheel") > "$build/build.log" 2>&1 || { tail -30 "$build/build.log"; exit 1; }
    touch "$build/done"
  fi
fi
# One pip call for the three: each --target install replaces transformer_engine/ whole, and
# a meta wheel without its core makes every import of megatron-core fail.
run rm -rf "$site"/transformer_engine "$site"/transformer_engine-* "$site"/transformer_engine_*
run "${install[@]}" "$wheel" "$deps"/transformer_engine-*.whl "$build"/wheel/*.whl
if [ $dry_run = 1 ]; then
  echo "dry run: nothing installed"
else
  "$py" -c "import transformer_engine.pytorch, transformer_engine_torch; print('TE ready:', transformer_engine.__version__)"
fi
