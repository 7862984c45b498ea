"""Resharding a checkpoint with the option, on the CPU: megatron-core's real DDP, distributed
optimizer and ``dist_checkpointing`` (torch_dist) through ``tests/support/cpu_megatron.py``,
at data-parallel sizes 1, 2 and 4.

The model of ``tests/test_megatron_cpu.py`` (bf16 MLP, an fp32 island ``alpha``, a natively
fp32 ``sink``), with ``sink`` in a param group of its own (a ``max_lr`` override, which no
scheduler reads here): at DP=2 and DP=4 the whole fp32 buffer lies in rank 0's shard, so
that group is empty on the other ranks.

The same data at every shape: step ``s`` trains on ``batch(0, s)`` and ``batch(1, s)``; at
DP=2 one each per rank; at DP=1 both as two micro-batches of half the loss each; at DP=4
ranks 0 and 1 as at DP=2 (their loss times 2, as DDP divides by 4), ranks 2 and 3 a batch
with its loss times 0 (gradients of exactly 0, which add nothing to the sum and round
nothing). The gradients are then the same bits at every shape (see ``TOLERANCE``); what
changes is how the optimizer state is sharded and the order in which the gradient norm's
squares are summed.

With ``MEGATRON_TEST_DEVICE=cuda`` the same file runs on GPU 0 (every rank on it, over
gloo; ``scripts/gpu_session.sh reshard``): the model moved there before megatron-core
builds its buffers, batches moved to the model's device, megatron-core's own CPU-offload
placement; no transformer-engine or Apex installed.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.support import offload_internals
from tests.support.megatron_mlp import BF16, batch, joined, owned_state, params_of
from tests.support.megatron_ranks import run_ranks, skip_unless_the_device_serves, to_model
from tests.support.mlp_stack import (
    TOLERANCE,
    _error,
    _sharded,
    adam_path,
    assert_close_normwise,
    assert_same,
    build,
    group_steps,
    load,
    path_options,
    save,
)

pytestmark = pytest.mark.mcore

pytest.importorskip("megatron.core")
skip_unless_the_device_serves()

SAVED_AT, STEPS = 2, 4  # save after two steps, continue to four
FORMATS = ("fully_reshardable", "dp_reshardable")


def train_steps(model, opt, rank: int, world: int, steps) -> list[float]:
    """Steps of the data every shape shares: rank ``r`` of 2 trains on ``batch(r, s)``;
    one rank trains on both, each with half the loss (DDP scales by 1/world instead); of 4,
    ranks 2 and 3 add gradients of exactly 0 (their loss times 0)."""
    norms = []
    for s in steps:
        model.zero_grad_buffer()
        opt.zero_grad()
        for r in range(rank, max(world, 2), world):
            (model(*to_model(model, *batch(r % 2, s))) * (world / 2 if r < 2 else 0.0)).backward()
        model.finish_grad_sync()
        ok, norm, _ = opt.step()
        assert ok
        norms.append(float(norm))
    return norms


def snapshot(model, opt) -> dict:
    chain = opt.chained_optimizers
    return dict(
        params=params_of(model),
        state=owned_state(model, opt),
        groups=group_steps(opt),
        chain=len(chain),
        expert_buffers=len(model.expert_parallel_buffers),
        # main parameters this rank's second optimizer (the expert one) steps
        expert_mains=sum(len(g["params"]) for g in chain[1].optimizer.param_groups)
        if len(chain) > 1
        else 0,
        # CPU offload: the inner optimizers' types, the host mirrors and CPU parameters
        # they hold, and whether the chunked step was built (None: not offloaded)
        inner=[type(c.optimizer).__name__ for c in chain],
        host_mirrors=sum(len(getattr(c.optimizer, "host_mirrors", ())) for c in chain),
        cpu_params=sum(len(getattr(c.optimizer, "cpu_copys_map_gpu_param", ())) for c in chain),
        chunked=[offload_internals.chunked_built(c.optimizer) for c in chain],
    )


def ckpt(out_dir: str, world: int, option: bool, fmt: str, path: str) -> str:
    return os.path.join(out_dir, f"ckpt-dp{world}-{'on' if option else 'off'}-{fmt}-{path}")


def reshard_job(rank, world, log, out_dir, plan):
    """Per (option, fmt, path) in ``plan["save"]``: STEPS steps from the common initial
    values, saving after SAVED_AT; per (option, fmt, path) in ``plan["probe"]``, whether
    the optimizer's sharded state dict in that format can be built after SAVED_AT steps; then per
    (saved_world, saved_option, option, fmt, path) in ``plan["load"]``, a run built from
    other values loads that checkpoint and continues to STEPS. Snapshots at the save, after
    the load and at the end; a load's or a probe's exception is its result."""
    out = {}
    for option, fmt, path in plan["save"]:
        with adam_path(path):
            model, opt = build(option, **path_options(path))
            norms = train_steps(model, opt, rank, world, range(SAVED_AT))
            at_save = snapshot(model, opt)
            try:
                save(model, opt, ckpt(out_dir, world, option, fmt, path), fmt)
                saved = None
            except Exception as e:  # noqa: BLE001 - stock's failure is a result too
                saved = _error(e)
            norms += train_steps(model, opt, rank, world, range(SAVED_AT, STEPS))
        out["run", option, fmt, path] = dict(at_save=at_save, end=snapshot(model, opt),
                                             norms=norms, save_error=saved)  # fmt: skip
    for option, fmt, path in plan.get("probe", []):
        with adam_path(path):
            model, opt = build(option, **path_options(path))
            train_steps(model, opt, rank, world, range(SAVED_AT))  # a state to save
            try:  # local: no collective, so a rank that fails here leaves no peer waiting
                _sharded(model, opt, fmt, loading=False)
                out["probe", option, fmt, path] = None
            except Exception as e:  # noqa: BLE001 - megatron-core's refusal is the result
                out["probe", option, fmt, path] = _error(e)
    for saved_world, saved_option, option, fmt, path in plan["load"]:
        key = "load", saved_world, saved_option, option, fmt, path
        with adam_path(path):
            model, opt = build(option, seed=12, **path_options(path))
            try:
                load(model, opt, ckpt(out_dir, saved_world, saved_option, fmt, path), fmt)
            except Exception as e:  # noqa: BLE001 - what megatron-core does is the result
                out[key] = _error(e)
                continue
            loaded = snapshot(model, opt)
            norms = train_steps(model, opt, rank, world, range(SAVED_AT, STEPS))
        out[key] = dict(loaded=loaded, end=snapshot(model, opt), norms=norms)
    return out


ON, OFF = True, False
FULL, DP = FORMATS
# (saved at, saved with, loaded with, format, Adam path, loaded at)
LOADS = [
    (2, ON, ON, FULL, "torch", 1),
    (2, ON, ON, DP, "torch", 1),
    (1, ON, ON, FULL, "torch", 2),
    (2, OFF, ON, FULL, "torch", 1),
    (1, ON, OFF, FULL, "apex", 2),
    (2, OFF, ON, FULL, "apex", 1),
    (2, ON, ON, FULL, "torch", 4),
    (4, ON, ON, FULL, "torch", 2),
    (4, ON, ON, FULL, "torch", 1),
    (2, OFF, ON, FULL, "apex", 4),
    (4, ON, OFF, FULL, "apex", 2),
    (2, ON, ON, FULL, "torch+experts", 1),
    (2, ON, ON, FULL, "torch+experts", 4),
    (4, ON, ON, FULL, "torch+experts", 2),
    (2, OFF, ON, FULL, "apex+experts", 4),
    # CPU offload through host mirrors, precision-aware (the GPU-resident part, at 0.5, on
    # torch's AdamW here), the per-parameter and the chunked step
    (2, ON, ON, FULL, "torch+offload1.0", 1),
    (2, ON, ON, FULL, "torch+offload0.5", 1),
    (2, ON, ON, DP, "torch+offload0.5", 1),
    (1, ON, ON, FULL, "torch+offload0.5", 2),
    (2, ON, ON, FULL, "torch+offload0.5", 4),
    (4, ON, ON, FULL, "torch+offload1.0", 2),
    (2, ON, ON, FULL, "torch+offload0.5+chunked", 1),
    (1, ON, ON, FULL, "torch+offload1.0+chunked", 2),
    # the GPU-resident part on the Apex path's FusedAdam, which counts steps per param group
    # (as transformer-engine's does): groups empty on some ranks at every DP size
    (2, ON, ON, FULL, "apex+offload0.5", 1),
    (1, ON, ON, FULL, "apex+offload0.5", 2),
    (2, ON, ON, FULL, "apex+offload0.5", 4),
    (4, ON, ON, FULL, "apex+offload0.5+chunked", 2),
]
# stock megatron-core cannot load these; what it does instead is asserted below
STOCK_TORCH_LOAD = (2, ON, OFF, FULL, "torch", 1)
STOCK_DP1_LOAD = (2, ON, OFF, FULL, "apex", 1)
# dp_reshardable cannot be built at DP=4 (DP_AT_4 below); what megatron-core does is asserted
PROBES = {4: [(ON, DP, "torch"), (OFF, DP, "torch")]}
# The spawns, in order: a size's first spawn runs its saves (the checkpoints and the
# uninterrupted runs at that size) and the loads of checkpoints saved earlier; a later
# spawn of the same size, the loads left.
SPAWNS = (2, 4, 1, 2)


def _plans() -> list[tuple[int, dict]]:
    loads = LOADS + [STOCK_TORCH_LOAD, STOCK_DP1_LOAD]
    saves = {w: set() for w in SPAWNS}
    for saved_world, saved_option, _, fmt, path, _ in loads:
        saves[saved_world].add((saved_option, fmt, path))
    for _, _, option, _, path, world in LOADS:
        saves[world].add((option, FULL, path))  # the uninterrupted run there
    plans, saved, left = [], set(), list(loads)
    for world in SPAWNS:
        first = world not in saved
        ready = [c for c in left if c[5] == world and (c[0] in saved or (first and c[0] == world))]
        assert all(c[0] != world for c in ready), "a load of its own size's checkpoint"
        left = [c for c in left if c not in ready]
        save = sorted(saves[world], key=repr) if first else []
        saved.add(world)
        probe = PROBES.get(world, []) if first else []
        if save or ready or probe:
            plans.append((world, dict(save=save, load=[c[:5] for c in ready], probe=probe)))
    assert not left, left
    return plans


@pytest.fixture(scope="module")
def reshard_runs(tmp_path_factory):
    """Every rank's results of the three spawns, keyed by (what, ..., world)."""
    tmp_path = tmp_path_factory.mktemp("reshard")
    out = {}
    for world, plan in _plans():
        for result in run_ranks(tmp_path, world, reshard_job, plan):
            for key, value in result.items():
                out.setdefault(key + (world,), []).append(value)
    return out


def full_state(snapshots: list[dict]) -> dict:
    """Per parameter name: its full main value and optimizer state, from every rank's
    pieces (each element exactly once)."""
    return {name: entry for (name, _, _), entry in joined([s["state"] for s in snapshots]).items()}


@pytest.mark.parametrize("case", LOADS, ids=lambda c: "dp{}{}-to-dp{}{}-{}-{}".format(
    c[0], "on" if c[1] else "off", c[5], "on" if c[2] else "off", c[3], c[4]))  # fmt: skip
def test_resharded_load_continues_like_the_uninterrupted_run(reshard_runs, case):
    """Saved at one DP size, loaded at the other into a model built from other values:
    parameters and every optimizer state tensor equal the saver's, joined by parameter
    name, bit for bit; every param group holds the saved ``step`` on every rank, the group
    empty on DP=2's rank 1 included; the continuation equals the uninterrupted run at the
    new size (same data, same initial values, the loading side's option and Adam) within
    ``TOLERANCE``: parameters, Adam state and norms. ``+experts``: ``w2`` is an expert
    weight (``allreduce=False``), so megatron-core builds expert DDP buffers and a second
    distributed optimizer (the chain of a MoE model, expert-parallel size 1).
    ``+offload<f>``: megatron-core's CPU offload at fraction f with the precision-aware
    optimizer, through host mirrors (the Adam state then holds the fp32 ``master_param``
    too); ``+chunked``: stepped by the chunked step."""
    saved_world, saved_option, option, fmt, path, world = case
    runs = reshard_runs[("load",) + case]
    assert len(runs) == world
    for r in runs:
        assert "error" not in r, r
    saver = reshard_runs["run", saved_option, fmt, path, saved_world]
    reference = reshard_runs["run", option, FULL, path, world]

    assert_same(full_state([r["loaded"] for r in runs]), full_state([s["at_save"] for s in saver]),
                "loaded")  # fmt: skip
    names = saver[0]["at_save"]["params"].keys()
    for r in runs:
        for n in names:
            assert torch.equal(r["loaded"]["params"][n].float(),
                               saver[0]["at_save"]["params"][n].float()), n  # fmt: skip
        steps = [(count, step) for count, step in r["loaded"]["groups"]]
        assert steps and all(step == SAVED_AT for _, step in steps), steps
    experts = path.endswith("+experts")  # then w2 is an expert weight: a chain of two
    for r in runs:
        assert (r["loaded"]["chain"], r["loaded"]["expert_buffers"]) == (
            (2, 1) if experts else (1, 0)
        )
    assert any(r["loaded"]["expert_mains"] for r in runs) == experts
    offloaded = "+offload" in path  # then host mirrors hold the CPU parameters
    for r in runs:
        assert (r["end"]["inner"] == ["HostMirrorHybridOptimizer"]) == offloaded, r["end"]
        assert (r["end"]["chunked"] == [True]) == ("+chunked" in path)
    if offloaded:  # on the ranks that own offloaded elements (at DP=4 not every rank does)
        assert any(r["end"]["host_mirrors"] and r["end"]["cpu_params"] for r in runs)
    if world == 2:  # sink's group: on rank 0 only
        assert [c for c, _ in runs[1]["loaded"]["groups"]].count(0) == 1
    if world > 1:  # a group empty on some rank, holding the saved step all the same
        assert any(c == 0 for r in runs for c, _ in r["loaded"]["groups"])
    for key, v in full_state([r["loaded"] for r in runs]).items():
        if "step" in v:  # torch's Adam: one per parameter
            assert v["step"].item() == SAVED_AT, key

    assert_close_normwise(full_state([r["end"] for r in runs]),
                          full_state([u["end"] for u in reference]), "continued")  # fmt: skip
    for r, u in zip(runs, reference, strict=True):
        assert r["norms"] == pytest.approx(u["norms"][SAVED_AT:], rel=TOLERANCE)
        for n, v in u["end"]["params"].items():
            if v.dtype == BF16:
                assert torch.equal(r["end"]["params"][n], v), n
        ended = [(c, s) for c, s in r["end"]["groups"]]
        want_end = [(c, s) for c, s in u["end"]["groups"]]
        assert [c for c, _ in ended] == [c for c, _ in want_end]
        if path.startswith("apex") and "+offload" not in path:  # one step per group
            assert [s for c, s in ended if c] == [STEPS] * sum(1 for c, _ in ended if c)
    for key, v in full_state([r["end"] for r in runs]).items():
        if "step" in v:
            assert v["step"].item() == STEPS, key


def test_dp_reshardable_at_dp4_is_refused_by_megatron_core_with_and_without_the_option(
    reshard_runs,
):
    """megatron-core 0.19.2's ``dp_reshardable`` state needs every data-parallel rank to own
    part of every bucket (``distrib_optimizer.py``: ``assert bucket_state, 'empty bucket
    encountered'``). Here the fp32 buffer holds 64 elements, all in rank 0's shard at DP=4,
    with the option (``alpha`` an island) and without (``alpha`` natively fp32) alike: the
    format cannot be saved or loaded at that shape; ``fully_reshardable`` can
    (``dp2on-to-dp4on-fully_reshardable-torch``, ``dp4on-to-dp2on-...``). A small fp32 buffer
    at a large DP size (islands of tiny parameters such as attention sinks at DP=64) meets
    the same refusal, stock or not."""
    for option in (ON, OFF):
        ranks = reshard_runs["probe", option, DP, "torch", 4]
        assert len(ranks) == 4
        refused = [r for r, result in enumerate(ranks) if result is not None]
        assert refused and 0 not in refused, (option, ranks)  # rank 0 owns all of it
        for r in refused:
            assert ranks[r]["error"] == "AssertionError: empty bucket encountered", ranks[r]


def test_stock_cannot_load_on_torch_adam(reshard_runs):
    """megatron-core 0.19.2 without TE or Apex (torch's Adam): building the loading state
    dict of a fresh stock optimizer asks its state for the one ``step`` and finds none
    (``state_dict``'s ``assert len(steps) == 1``). The option loads the same checkpoint
    (``dp2on-to-dp1on``); stock loads it on the Apex path (``dp2on-to-dp1off``)."""
    (r,) = reshard_runs[("load",) + STOCK_TORCH_LOAD]
    assert r.get("error", "").startswith("AssertionError"), r
    assert "len(steps) == 1" in r["where"], r


def test_stock_cannot_load_fp32_beside_bf16_at_one_rank(reshard_runs):
    """megatron-core 0.19.2, option off, at DP=1 on the Apex path: ``alpha`` (natively
    fp32 without the option) shares a param group with bf16 ``b1``, and stock's load of the
    fully-reshardable state copies one parameter's state into the other's place: a size
    error (32 against 48), no wrong data. Stock loads at DP=2 (``dp1on-to-dp2off``)."""
    (r,) = reshard_runs[("load",) + STOCK_DP1_LOAD]
    assert r.get("error", "").startswith("RuntimeError: The size of tensor a"), r
    assert r["where"].startswith("distrib_optimizer.py"), r


def fraction_change_job(rank, world, log, out_dir, hops):
    """A run through ``hops`` ((Adam path, steps) each): the first hop trains from the
    initial values, every later one is a fresh model built from other values that loads
    the previous hop's checkpoint (saved after its steps) and continues; then the
    uninterrupted run with the last hop's path over all the steps."""
    done, groups, resumed = 0, [], None
    for k, (path, steps) in enumerate(hops):
        with adam_path(path):
            model, opt = build(True, seed=11 if k == 0 else 12, **path_options(path))
            if k:
                load(model, opt, os.path.join(out_dir, f"ckpt-hop{k - 1}"), FULL)
                groups.append(group_steps(opt))  # as loaded
            norms = train_steps(model, opt, rank, world, range(done, done + steps))
            done += steps
            if k < len(hops) - 1:
                save(model, opt, os.path.join(out_dir, f"ckpt-hop{k}"), FULL)
            resumed = dict(end=snapshot(model, opt), norms=norms)
    with adam_path(hops[-1][0]):
        model, opt = build(True, **path_options(hops[-1][0]))
        norms = train_steps(model, opt, rank, world, range(done))
        plain = dict(end=snapshot(model, opt), norms=norms)
    return dict(groups=groups, resumed=resumed, plain=plain, steps=done)


@pytest.mark.parametrize(
    "hops",
    [
        (("apex+offload0.5", 2), ("apex+offload0.0", 2)),
        (("apex+offload0.0", 2), ("apex+offload0.5", 2), ("apex+offload0.0", 2)),
    ],
    ids=["host-then-gpu", "gpu-host-gpu"],
)
def test_a_group_on_the_host_at_a_save_steps_right_on_the_gpu_after_a_load(tmp_path, hops):
    """Offload fraction 0.5 puts the weight-decay group (``w1``, ``w2``) wholly on the
    host, where torch's AdamW counts steps per parameter (that group's own ``step`` in the
    offload optimizer is then not advanced); at fraction 0 that group steps on the GPU with
    a FusedAdam that counts per group (the Apex path's stand-in, as transformer-engine's),
    starting from the group's loaded ``step``. Every load gives every group the step count
    (megatron-core's checkpoint writes the host AdamW's per-parameter count into every
    saved group), and the last hop's continuation equals the uninterrupted fraction-0 run
    within ``TOLERANCE`` (the host's and the GPU's Adam round differently)."""
    (r,) = run_ranks(tmp_path, 1, fraction_change_job, hops)
    done = 0
    for (_, steps), groups in zip(hops[:-1], r["groups"], strict=True):
        done += steps
        assert [s for c, s in groups if c] == [done] * 3, r["groups"]
    last = r["resumed"]["end"]
    assert last["inner"] == ["HostMirrorHybridOptimizer"] and last["cpu_params"] == 0
    assert_close_normwise(
        full_state([last]), full_state([r["plain"]["end"]]), "after the last load"
    )
    n = hops[-1][1]
    assert r["resumed"]["norms"] == pytest.approx(r["plain"]["norms"][-n:], rel=TOLERANCE)
