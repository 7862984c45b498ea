#!/usr/bin/env bash
# Run the CPU tests that touch megatron-core against other megatron-core versions.
#
# Usage: bash scripts/mcore_matrix.sh [--allow-fail] [--pin-main [GIT_DIR]] [VERSION ...] [-- PYTEST_ARGS]
#   VERSION   a megatron-core release on PyPI (0.18.2) or "main" (Megatron-LM main at the
#             commit pinned in scripts/mcore_main.sha). Default: $MCORE_MATRIX_VERSIONS, else
#             "0.18.2 0.19.0 main".
#   --allow-fail      report failing versions but exit 0 (also MCORE_MATRIX_ALLOW_FAIL=1).
#   --pin-main [DIR]  pin scripts/mcore_main.sha to the `main` branch of a local Megatron-LM git
#                     dir (default $MEGATRON_LM_GIT_DIR or the fetch tool's mirror), then run.
#   MCORE_MATRIX_TESTS  the test files to run (default: every tests/test_*.py marked
#                       `pytestmark = pytest.mark.mcore`, listed by scripts/mcore_matrix_tests.py:
#                       the files that touch megatron-core, directly or through what they import;
#                       tests/test_mcore_marker.py checks that exactly those carry the mark).
#   MCORE_MATRIX_EXCLUDE  test files to leave out of that list (e.g. tests/test_benchmarks.py,
#                         the slowest file, whose scripts only use megatron_ext's public API).
#
# Each release is installed once into .mcore/<version>/ with `pip install --no-deps --target`
# (torch and the rest come from .venv; a requirement .venv lacks is installed into that folder
# too), reused while its stamp file .mcore/<version>/.complete is there. "main" never touches
# the network: megatron/core and megatron/training (what the megatron-core wheel ships; with
# only megatron/core, `megatron.training` would come from .venv's release) are extracted with
# `git archive` from a local Megatron-LM git dir into .mcore-src/main-<sha12>/ (not built: no
# compiled dataset helpers; a minimal dist-info so importlib.metadata agrees); with
# neither that folder nor a local git dir holding the pinned commit, main is skipped with a
# message saying so (a SKIP row in the summary, not a failure). The version's folder goes first
# on PYTHONPATH, so it shadows the venv's megatron-core; scripts/mcore_matrix_plugin.py checks
# inside the test run that megatron.core (and megatron.training) come from that folder and reports the intended
# version, and prints it. Logs: .mcore/logs/<version>.log. Exit status 1 when a version fails.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
case " $* " in *" -h "*|*" --help "*) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;; esac
if [ -z "${PY:-}" ]; then
  source "$root/scripts/setup_env.sh" # sets $PY; installs the project when pyproject.toml changed
fi
cd "$root"

allow_fail=${MCORE_MATRIX_ALLOW_FAIL:-0}
pin_file="$root/scripts/mcore_main.sha"
default_git_dir=/work/.mirror/NVIDIA+Megatron-LM/repo
git_dir=${MEGATRON_LM_GIT_DIR:-$default_git_dir}
versions=()
pytest_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --allow-fail) allow_fail=1 ;;
    --pin-main)
      if [ $# -gt 1 ] && [ -d "$2" ]; then git_dir=$2; shift; fi
      sha=$(git --git-dir="$git_dir" rev-parse --verify 'main^{commit}')
      git --git-dir="$git_dir" log -1 --format="%H %cs %s" "$sha" >"$pin_file"
      echo "[matrix] pinned Megatron-LM main: $(cat "$pin_file")"
      ;;
    --) shift; pytest_args=("$@"); break ;;
    -*) echo "error: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) versions+=("$1") ;;
  esac
  shift
done
if [ ${#versions[@]} -eq 0 ]; then
  read -r -a versions <<<"${MCORE_MATRIX_VERSIONS:-0.18.2 0.19.0 main}"
fi

if [ -n "${MCORE_MATRIX_TESTS:-}" ]; then
  read -r -a tests <<<"$MCORE_MATRIX_TESTS"
else
  listed=$("$PY" scripts/mcore_matrix_tests.py)
  mapfile -t tests <<<"$listed"
fi
for x in ${MCORE_MATRIX_EXCLUDE:-}; do
  for i in "${!tests[@]}"; do [ "${tests[$i]}" = "$x" ] && unset 'tests[i]'; done
done
tests=("${tests[@]}")
echo "[matrix] test files: ${tests[*]}"

workers=$(bash "$root/scripts/test_workers.sh") # pytest-xdist's workers, as scripts/test.sh
mkdir -p .mcore/logs
export NO_VCS_VERSION=1 # else megatron-core appends `git rev-parse HEAD` of *this* repository
export PYTHONWARNINGS="ignore:Transformer Engine and Apex,ignore:absl.logging is not installed"

# Install requirements of the version in $1 that .venv lacks into $1 itself ($2: may use the
# network). Prints what it installs.
install_missing() {
  local dir=$1 online=$2 missing
  missing=$("$PY" scripts/mcore_matrix_deps.py "$dir")
  [ -z "$missing" ] && return 0
  echo "[matrix] $(basename "$dir") needs what .venv lacks: $(echo "$missing" | tr '\n' ' ')"
  if [ "$online" != 1 ]; then
    echo "[matrix] error: not installing from the network for a local source tree" >&2
    return 1
  fi
  # shellcheck disable=SC2086
  "$PY" -m pip install -q --no-deps --target "$dir" $missing
  missing=$("$PY" scripts/mcore_matrix_deps.py "$dir")
  if [ -n "$missing" ]; then
    echo "[matrix] error: still unsatisfied in $dir: $missing" >&2
    return 1
  fi
}

# Sets $dir and $expect for the release $1, installing it when its stamp is missing.
prepare_release() {
  local v=$1
  dir="$root/.mcore/$v"
  if [ ! -f "$dir/.complete" ]; then
    echo "[matrix] installing megatron-core==$v into .mcore/$v (no deps; torch stays .venv's)"
    rm -rf "$dir"
    "$PY" -m pip install -q --disable-pip-version-check --no-deps --target "$dir" "megatron-core==$v"
    install_missing "$dir" 1
    echo "$v" >"$dir/.complete"
  fi
  expect=$v
}

# Sets $dir and $expect for Megatron-LM main at the pinned commit, or $skip when no local
# source has it. Never uses the network.
prepare_main() {
  skip=
  if [ ! -f "$pin_file" ]; then
    echo "[matrix] SKIP main: no pinned commit ($pin_file is missing; run with --pin-main)"
    skip="no pinned commit"
    return 0
  fi
  local sha short tmp
  sha=$(cut -d' ' -f1 "$pin_file")
  short=${sha:0:12}
  dir="$root/.mcore-src/main-$short"
  echo "[matrix] Megatron-LM main pinned at: $(cat "$pin_file")"
  if [ ! -f "$dir/.complete" ]; then
    if ! git --git-dir="$git_dir" cat-file -e "$sha^{commit}" 2>/dev/null; then
      echo "[matrix] SKIP main: no local Megatron-LM source at $sha: neither .mcore-src/main-$short/"
      echo "[matrix]   nor a git dir holding that commit (looked in ${git_dir}; set MEGATRON_LM_GIT_DIR"
      echo "[matrix]   to a Megatron-LM clone or mirror). Main is never fetched from the network here."
      skip="no local source"
      return 0
    fi
    echo "[matrix] extracting megatron/core, megatron/training at $short from $git_dir into .mcore-src/main-$short"
    rm -rf "$dir"
    tmp=$(mktemp -d "$root/.mcore-src.tmp.XXXXXX")
    git --git-dir="$git_dir" archive "$sha" megatron/core megatron/training pyproject.toml LICENSE | tar -x -C "$tmp"
    "$PY" - "$tmp" "$sha" <<'EOF'
import re, sys, tomllib
from pathlib import Path
tmp, sha = Path(sys.argv[1]), sys.argv[2]
text = (tmp / "megatron/core/package_info.py").read_text()
parts = {k: re.search(rf"^{k} = ['\"]?([^'\"\n]*)['\"]?$", text, re.M).group(1)
         for k in ("MAJOR", "MINOR", "PATCH", "PRE_RELEASE")}
version = f"{parts['MAJOR']}.{parts['MINOR']}.{parts['PATCH']}{parts['PRE_RELEASE']}"
deps = tomllib.loads((tmp / "pyproject.toml").read_text())["project"].get("dependencies", [])
info = tmp / f"megatron_core-{version}.dist-info"
info.mkdir()
meta = ["Metadata-Version: 2.1", "Name: megatron-core", f"Version: {version}"]
meta += [f"Requires-Dist: {d}" for d in deps]
(info / "METADATA").write_text("\n".join(meta) + "\n")
(info / "INSTALLER").write_text("mcore_matrix.sh (git archive of Megatron-LM " + sha + ")\n")
(tmp / "COMMIT").write_text(sha + "\n")
print(version)
EOF
    install_missing "$tmp" 0
    mkdir -p "$root/.mcore-src"
    mv "$tmp" "$dir"
    date -u +%FT%TZ >"$dir/.complete"
  fi
  expect=$("$PY" -c 'import sys; from importlib import metadata; print(metadata.Distribution.at(sys.argv[1]).version)' "$(ls -d "$dir"/megatron_core-*.dist-info | head -1)")
}

names=()
results=()
status=0
for v in "${versions[@]}"; do
  start=$(date +%s%N)
  echo
  echo "== megatron-core $v: ${#tests[@]} test files"
  if [ "$v" = main ]; then
    prepare_main
    if [ -n "$skip" ]; then
      names+=("main"); results+=("SKIP ($skip)"); continue
    fi
  else
    prepare_release "$v"
  fi
  log=".mcore/logs/$v.log"
  rc=0
  PYTHONPATH="$dir:$root/scripts${PYTHONPATH:+:$PYTHONPATH}" MCORE_MATRIX_EXPECT="$expect" \
    MCORE_MATRIX_DIR="$dir" "$PY" -m pytest -q -rfEs -p mcore_matrix_plugin -p no:cacheprovider \
    -n "$workers" "${tests[@]}" "${pytest_args[@]}" 2>&1 | tee "$log" || rc=$? # pipefail: pytest's status
  ms=$((($(date +%s%N) - start) / 1000000))
  secs=$(printf '%d.%d' $((ms / 1000)) $((ms % 1000 / 100)))
  summary=$(grep -v "^[[:space:]]*$" "$log" | tail -n 1 | sed 's/^=* *//; s/ *=*$//')
  names+=("$v ($expect)")
  if [ $rc -eq 0 ]; then
    results+=("PASS $(printf '%6ss' "$secs")  $summary")
  else
    results+=("FAIL $(printf '%6ss' "$secs")  $summary")
    status=1
  fi
done

echo
echo "== megatron-core matrix (logs in .mcore/logs/)"
for i in "${!names[@]}"; do
  printf '  %-22s %s\n' "${names[$i]}" "${results[$i]}"
done
if [ $status -ne 0 ] && [ "$allow_fail" = 1 ]; then
  echo "[matrix] some versions failed; exiting 0 because of --allow-fail / MCORE_MATRIX_ALLOW_FAIL=1"
  exit 0
fi
exit $status
