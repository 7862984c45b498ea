#!/usr/bin/env bash
# On the GPU test machine: install the carried megatron-core wheel, then run the named steps,
# each under its own time limit, logging to $OUT/<step>.log. Usage: gpu_session.sh STEP...
# Steps: tests, multirank, pytest, example, offload_overlap, overlap_forward, reshard (tests/test_megatron_cpu_reshard.py, _tp.py
# and _pp.py on the GPU, MEGATRON_TEST_DEVICE=cuda; before te), te, norm_clip, memory, train_step, offload, clip_step,
# offload_step (fractions 1.0 and 0.5; OFFLOAD_STEP_ARGS replaces its --threads 4 8 16 --warmup 1
# --reps 20 --rounds 2: about 2 minutes each at the default GPT size),
# megatron_lm (tests/gpu/test_megatron_lm_gpu.py, -k "$MEGATRON_LM_K"; scripts from
# .megatron-lm/ unless MEGATRON_LM_PATH is set), pytest (the files in PYTEST_ARGS, with
# -k "$PYTEST_K"), te (transformer-engine into /tmp/site: scripts/install_te.sh over the parts
# stashed so far and the transferred .te/deps, see docs/testing.md; put it before the steps that
# need TE), te_layers (tests/gpu/test_te_layers_gpu.py: a GPT with TE's layer spec, ours vs
# stock; table and JSON in $OUT/te_layers), megatron_lm_te (tests/gpu/megatron_lm_te.py:
# pretrain_gpt.py with TE's layers, 20 iterations per configuration, ours vs stock; JSON,
# table and PNG in $OUT/megatron_lm_te; MEGATRON_LM_TE_ARGS adds its flags, e.g. --configs),
# megatron_lm_scale (tests/gpu/megatron_lm_scale.py: pretrain_gpt.py at a GPT-3 size with the
# offload flags, ours only; MEGATRON_LM_SCALE_ARGS its arguments; after te).
# scale (benchmarks/offload_scale.py at one size: SCALE_ARGS its arguments, required, e.g.
# "--size 2.7b --kinds fwd_bwd exact"; each kind in a process of its own; SCALE_LIMIT, default
# 540 s; DeepSpeed from .whl/deepspeed/ when carried, scripts/fetch_deepspeed_wheels.sh).
# NORM_CLIP_ARGS replaces norm_clip's extra args. pack (last): everything under $OUT into
# $OUT/results.tgz. Without .whl/*.whl, the megatron-core a previous call installed is used.
set -uo pipefail
OUT=${OUT:-/tmp/out}
# The wheel travels with the first call; a later call on the same machine may leave it behind.
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
elif [ ! -d /tmp/site/megatron/core ]; then
  echo "gpu_session.sh: no megatron-core wheel in .whl/ and none installed in /tmp/site" \
    "(run scripts/fetch_gpu_wheels.sh and transfer .whl)" >&2
  exit 1
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
mkdir -p "$OUT/bench"
step() {  # name, limit in seconds, command...
  local name=$1 limit=$2; shift 2
  echo "=== $name: $*"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "=== $name exit $?"
  grep -E "passed|failed|error" "$OUT/$name.log" | tail -3 || true
}
for s in "$@"; do
  case $s in
    tests) step tests ${TESTS_LIMIT:-300} python3 -m pytest -p no:cacheprovider -v -m "cuda or not cuda" \
      -W ignore::UserWarning -W ignore::DeprecationWarning -rfE tests/gpu/test_offload_gpu.py \
      tests/gpu/test_reliability_gpu.py tests/gpu \
      --ignore=tests/gpu/test_multirank_gpu.py --ignore=tests/gpu/test_te_layers_gpu.py \
      tests/test_storage.py tests/test_storage_hooks.py \
      tests/test_lists.py tests/test_backends.py tests/test_distributed.py \
      tests/test_properties.py tests/test_plan.py tests/test_megatron_spans.py \
      tests/test_clipped_step.py tests/test_per_param_norms.py ;;
    multirank) step multirank ${MULTIRANK_LIMIT:-560} python3 -m pytest -p no:cacheprovider -q \
      -m cuda -s -rfE tests/gpu/test_multirank_gpu.py ;;
    pytest) read -ra targets <<< "${PYTEST_ARGS:?pytest step: set PYTEST_ARGS}"
      step pytest ${PYTEST_LIMIT:-300} python3 -m pytest -p no:cacheprovider -q -m "cuda or not cuda" \
      -s -rfE "${targets[@]}" -k "${PYTEST_K:-not nothing}" ;;
    example) step example 120 python3 examples/megatron_quickstart.py ;;
    overlap_forward)  # the overlapped exact offload step's training-loop tests on the GPU:
      # 1 and 2 ranks on GPU 0 over gloo, real streams and pinned copies (no TE needed)
      MEGATRON_TEST_DEVICE=cuda PYTHONPATH=$PWD/tests/support/multirank:$PYTHONPATH \
        step overlap_forward ${OVERLAP_FORWARD_LIMIT:-300} python3 -m pytest -p no:cacheprovider \
        -q -rfEs tests/test_offload_overlap_forward.py tests/test_offload_delayed_training.py \
        -k "exact_steps_bits or two_ranks or refuses or training_loop" ;;
    reshard)  # the CPU suite's resharding matrix on the GPU: every rank on GPU 0 over gloo,
      # megatron-core's own CUDA code; before `te` (its torch-Adam paths need no TE installed)
      MEGATRON_TEST_DEVICE=cuda PYTHONPATH=$PWD/tests/support/multirank:$PYTHONPATH \
        step reshard ${RESHARD_LIMIT:-500} python3 -m pytest -p no:cacheprovider -q -rfEs \
        tests/test_megatron_cpu_reshard.py tests/test_megatron_cpu_tp.py \
        tests/test_megatron_cpu_pp.py ;;
    te) step te ${TE_LIMIT:-400} bash scripts/install_te.sh ;;
    megatron_lm) MEGATRON_LM_PATH=${MEGATRON_LM_PATH:-$PWD/.megatron-lm} \
      MEGATRON_LM_TIMEOUT=${MEGATRON_LM_TIMEOUT:-150} step megatron_lm ${MEGATRON_LM_LIMIT:-400} \
      python3 -m pytest -p no:cacheprovider -q -m cuda -s -rfE tests/gpu/test_megatron_lm_gpu.py \
      -k "${MEGATRON_LM_K:-not nothing}" ;;
    te_layers) TE_LAYERS_OUT=$OUT/te_layers step te_layers ${TE_LAYERS_LIMIT:-560} python3 -m pytest \
      -p no:cacheprovider -q -m cuda -s -rfE tests/gpu/test_te_layers_gpu.py ;;
    megatron_lm_te) read -ra extra <<< "${MEGATRON_LM_TE_ARGS:-}"
      MEGATRON_LM_PATH=${MEGATRON_LM_PATH:-$PWD/.megatron-lm} step megatron_lm_te \
      ${MEGATRON_LM_TE_LIMIT:-560} python3 tests/gpu/megatron_lm_te.py --out "$OUT/megatron_lm_te" \
      "${extra[@]}" ;;
    megatron_lm_scale)  # pretrain_gpt.py at a GPT-3 size, offload 1.0, islands, ours only,
      # one configuration at a time; MEGATRON_LM_SCALE_ARGS its arguments (default: 6.7b, the
      # delayed update, 20 iterations); the table at the log's end
      read -ra extra <<< "${MEGATRON_LM_SCALE_ARGS:---size 6.7b --configs delayed}"
      MEGATRON_LM_PATH=${MEGATRON_LM_PATH:-$PWD/.megatron-lm} step megatron_lm_scale \
      ${MEGATRON_LM_SCALE_LIMIT:-580} python3 tests/gpu/megatron_lm_scale.py \
      --out "$OUT/megatron_lm_scale" "${extra[@]}"
      tail -n 12 "$OUT/megatron_lm_scale.log" ;;
    norm_clip|memory|train_step|offload|clip_step)
      extra=(); [ "$s" = norm_clip ] && read -ra extra <<< "${NORM_CLIP_ARGS:---scaling-counts 80,1000,10000}"
      step "$s" ${BENCH_LIMIT:-300} python3 "benchmarks/$s.py" --device cuda --out "$OUT/bench" "${extra[@]}" ;;
    offload_overlap)  # training steps at 1/4/8 micro-batches: GPU-resident, stock offload,
      # ours exact and delayed, fractions 1.0 and 0.5; OFFLOAD_OVERLAP_ARGS replaces
      # --loss-steps 200 (the loss curves of exact vs delayed)
      read -ra extra <<< "${OFFLOAD_OVERLAP_ARGS:---loss-steps 200}"
      step offload_overlap ${BENCH_LIMIT:-300} python3 benchmarks/offload_overlap.py --device cuda \
        --out "$OUT/bench" "${extra[@]}" ;;
    scale)  # one GPT size, its kinds each in a fresh process; the table at the log's end.
      # DeepSpeed's wheels (pure Python, its CPU Adam compiled on first use by ninja) go to a
      # folder of their own, on the path of this step only
      read -ra extra <<< "${SCALE_ARGS:?scale step: set SCALE_ARGS, e.g. --size 2.7b}"
      if compgen -G ".whl/deepspeed/*.whl" > /dev/null; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
          --target /tmp/ds-site .whl/deepspeed/*.whl || exit 1
      fi
      PYTHONPATH=$PYTHONPATH:/tmp/ds-site PATH=/tmp/ds-site/bin:$PATH step scale \
        ${SCALE_LIMIT:-540} python3 benchmarks/offload_scale.py --device cuda --out "$OUT/bench" \
        "${extra[@]}"
      tail -n 40 "$OUT/scale.log" ;;
    offload_step)  # fractions 1.0 and 0.5, each at several CPU thread counts
      read -ra extra <<< "${OFFLOAD_STEP_ARGS:---threads 4 8 16 --warmup 1 --reps 20 --rounds 2}"
      for f in 1.0 0.5; do
        step "offload_step_$f" ${BENCH_LIMIT:-300} python3 benchmarks/offload_step.py --device cuda \
          --out "$OUT/bench/offload_step_$f" --fraction "$f" "${extra[@]}"
      done ;;
    pack)  # the files under $OUT into one $OUT/results.tgz (a transfer back takes few files,
      # each of a limited size): tensors (*.pt, e.g. te_layers' parameters) and files over
      # 4 MiB are left out and listed
      (cd "$OUT" && find . -type f \( -name '*.pt' -o -size +4M \) -printf 'left out: %p (%s bytes)\n'
       find . -type f ! -name '*.pt' -size -4M > /tmp/pack.list
       tar czf /tmp/results.tgz -T /tmp/pack.list) && find "$OUT" -mindepth 1 -delete \
        && mv /tmp/results.tgz "$OUT/results.tgz" && echo "=== pack: $OUT/results.tgz" ;;
    *) echo "unknown step $s"; exit 2 ;;
  esac
done
