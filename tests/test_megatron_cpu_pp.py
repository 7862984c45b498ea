"""Pipeline parallelism with the option, on the CPU: megatron-core's DDP, distributed
optimizer and ``dist_checkpointing`` (torch_dist) through ``tests/support/cpu_megatron.py``
at PP=1 and PP=2 (one rank per stage), with one data-parallel rank and with two (PP=2 x
DP=2 at four ranks), and checkpoints resharded between these shapes.

The model, split in two stages: stage 0 holds ``w1`` (bf16) and ``alpha`` (a bf16
parameter marked ``keep_in_fp32``: an fp32 island; natively fp32 without the option) and
computes ``h = relu(x @ w1.T).float() * alpha``; stage 1 holds ``w2`` (bf16) and a natively
fp32 ``sink`` and computes ``y = (h.bf16() @ w2.T).float() + sink`` and the squared error.
At PP=1 one module holds all four parameters under the same names and runs both stages in
one autograd graph; at PP=2 stage 0 sends ``h`` to stage 1 and receives its gradient back
(gloo point-to-point), the schedule a pipeline runs with one micro-batch. The gradients are
the same bits either way (the same operations on the same inputs); what PP changes is that
each stage's DDP, buffers and optimizer hold only its own parameters, that the gradient norm
and clipping need both stages (megatron-core reduces the norm over the model-parallel
group), and that a checkpoint is written by two ranks with different parameters.

Oracles: every step's norm against the fp64 norm of the gradients in the buffers (summed
over the stages); PP=2 trains as PP=1 (norms, parameters and every Adam state tensor,
within the norm's summation order); a checkpoint saved at one PP size and loaded at the
other holds the saver's full state bit for bit, and the continuation equals the
uninterrupted run at the new size within ``TOLERANCE``.

With ``MEGATRON_TEST_DEVICE=cuda`` the same file runs on GPU 0, every rank on it over gloo
(``scripts/gpu_session.sh reshard``); the activations and their gradients still cross
between the stages as host tensors.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.support import mlp_stack, reshard_plans
from tests.support.megatron_mlp import BF16, CLIP, LR, F, H, batch, owned_pieces
from tests.support.megatron_ranks import rank_device, skip_unless_the_device_serves, to_model

pytestmark = pytest.mark.mcore

pytest.importorskip("megatron.core")
skip_unless_the_device_serves()

SAVED_AT = reshard_plans.SAVED_AT  # run_plan saves after 2 steps, continues to 4
FULL, DP = "fully_reshardable", "dp_reshardable"
TOLERANCE = mlp_stack.TOLERANCE  # the norm's two-stage sum vs one sum: its rounding only
STAGES = {0: ("w1", "alpha"), 1: ("w2", "sink")}


def initial(option: bool, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    values = {
        "w1": (torch.randn(F, H, generator=g) * 0.3).to(BF16),
        "alpha": torch.randn(F, generator=g).to(BF16),
        "w2": (torch.randn(H, F, generator=g) * 0.3).to(BF16),
        "sink": torch.randn(H, generator=g),
    }
    if not option:
        values["alpha"] = values["alpha"].float()  # the same values, created fp32
    return values


def stage0(p, x):
    return torch.relu(x @ p["w1"].t()).float() * p["alpha"].float()


def stage1(p, h, t):
    y = (h.to(BF16) @ p["w2"].t()).float() + p["sink"]
    return ((y - t) ** 2).sum() / t.shape[0]


def build(option: bool, pp: int, seed: int = 11):
    """Parallel state at PP=``pp``, this rank's stage (or both at PP=1), DDP and the
    distributed optimizer (Adam, clipped)."""
    from megatron.core import parallel_state as ps
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer.module import MegatronModule
    from megatron.core.transformer.transformer_config import TransformerConfig

    import megatron_ext

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(pipeline_model_parallel_size=pp)
    stage = ps.get_pipeline_model_parallel_rank() if pp > 1 else None
    names = STAGES[stage] if stage is not None else STAGES[0] + STAGES[1]
    tcfg = TransformerConfig(
        num_layers=2, hidden_size=H, num_attention_heads=4, bf16=True, params_dtype=BF16,
        pipeline_model_parallel_size=pp, pipeline_dtype=BF16,
    )  # fmt: skip

    class Stages(MegatronModule):
        def __init__(self):
            super().__init__(tcfg)
            for name, value in initial(option, seed).items():
                if name in names:
                    self.register_parameter(name, torch.nn.Parameter(value.clone()))
            if option and "alpha" in names:
                megatron_ext.mark_keep_in_fp32(self.alpha)

        def forward(self, *args):
            p = dict(self.named_parameters())
            if stage == 0:
                return stage0(p, args[0])
            if stage == 1:
                return stage1(p, *args)
            x, t = args
            return stage1(p, stage0(p, x), t)

    ddp_config = megatron_ext.DistributedDataParallelConfig(
        per_dtype_grad_buffers=option, use_distributed_optimizer=True
    )
    module = Stages().to(rank_device())  # megatron-core's buffers are made on its device
    model = megatron_ext.DistributedDataParallel(tcfg, ddp_config, module)
    ocfg = OptimizerConfig(
        optimizer="adam", lr=LR, clip_grad=CLIP, bf16=True, use_distributed_optimizer=True
    )
    return model, megatron_ext.get_megatron_optimizer(ocfg, [model]), stage


def forward_backward(model, stage, s) -> None:
    """One micro-batch ``batch(0, s)`` (every data-parallel rank the same) through the
    stages: at PP=2 the activation goes to the next stage of this rank's pipeline and its
    gradient comes back."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    x, t = to_model(model, *batch(0, s))
    # activations and their gradients cross between stages through host tensors (gloo's
    # point-to-point ops take CPU tensors), whatever the model's device
    if stage is None:
        model(x, t).backward()
    elif stage == 0:
        h = model(x)
        nxt = ps.get_pipeline_model_parallel_next_rank()
        dist.send(h.detach().cpu().contiguous(), dst=nxt)
        grad = torch.empty(h.shape, dtype=h.dtype)
        dist.recv(grad, src=nxt)
        h.backward(grad.to(h.device))
    else:
        prev = ps.get_pipeline_model_parallel_prev_rank()
        received = torch.empty(x.shape[0], F, dtype=torch.float32)
        dist.recv(received, src=prev)
        h = received.to(x.device).requires_grad_(True)
        model(h, t).backward()
        dist.send(h.grad.cpu().contiguous(), dst=prev)


def fp64_norm(model) -> float:
    """The gradient norm in fp64 over the gradients this rank owns in its buffers, summed
    over the data-parallel group and then over the pipeline stages."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    total = torch.zeros(1, dtype=torch.float64)
    for _, _, _, piece in owned_pieces(model):
        total += piece.double().square().sum().cpu()
    dist.all_reduce(total, group=ps.get_data_parallel_group())
    dist.all_reduce(total, group=ps.get_pipeline_model_parallel_group())
    return math.sqrt(total.item())


def train(model, opt, stage, steps) -> tuple[list[float], list[float]]:
    norms, refs = [], []
    for s in steps:
        model.zero_grad_buffer()
        opt.zero_grad()
        forward_backward(model, stage, s)
        model.finish_grad_sync()
        refs.append(fp64_norm(model))
        ok, norm, _ = opt.step()
        assert ok
        norms.append(float(norm))
    return norms, refs


def pp_job(rank, world, log, out_dir, plan):
    """At PP=``plan["pp"]`` (data-parallel size ``world`` / PP): the TP tests' plan
    (:func:`tests.support.reshard_plans.run_plan`)."""
    pp = plan["pp"]

    def make(option, seed):
        model, opt, stage = build(option, pp, seed)
        return model, opt, lambda steps: train(model, opt, stage, steps)

    return reshard_plans.run_plan(plan, (pp, world // pp), out_dir, make)


# (world, plan); shapes are (PP, DP). PP=2 saves in both formats (and with the option off);
# PP=1 runs, saves, and loads PP=2's (the option-off one with the option on); PP=2 then
# loads PP=1's. PP and DP together: PP=2 x DP=2 (four
# ranks) saves; PP=1 x DP=2 runs and loads it. Every data-parallel rank trains on the same
# batch, so the data-parallel mean is the same gradient at every DP size.
PLANS = [
    (2, dict(pp=2, run=[True, False], save=[FULL, DP], save_off=[FULL], load=[])),
    (
        1,
        dict(
            pp=1,
            run=[True, False],
            save=[FULL],
            load=[((2, 1), FULL), ((2, 1), DP), ((2, 1), FULL, "off")],
        ),
    ),  # fmt: skip
    (2, dict(pp=2, run=[], save=[], load=[((1, 1), FULL)])),
    (4, dict(pp=2, run=[True], save=[FULL], load=[])),
    (2, dict(pp=1, run=[True], save=[], load=[((2, 2), FULL)])),
]


@pytest.fixture(scope="module")
def pp_runs(tmp_path_factory):
    """Every rank's results, keyed by (what, ..., (PP, DP)), in rank order."""
    return reshard_plans.runs_by_shape(tmp_path_factory.mktemp("pp"), pp_job, PLANS, "pp")


def merged(per_rank: list[dict], key: str) -> dict:
    """The stages' states joined: every parameter name once (the data-parallel ranks of a
    stage hold the same joined state: checked equal)."""
    out: dict = {}
    for r in per_rank:
        for name, entry in r[key].items():
            if name in out:
                mlp_stack.assert_same({name: entry}, {name: out[name]}, "data-parallel copies")
            out[name] = entry
    return out


@pytest.mark.parametrize("option", [True, False], ids=["on", "off"])
def test_two_stages_train_as_one(pp_runs, option):
    """Every step's norm within 1e-6 of the fp64 norm over both stages' buffers, on both
    stages (the same number: megatron-core reduces it over the model-parallel group); the
    fp64 norms at PP=1 and PP=2 the same (the same gradients); norms, parameters and Adam
    state within ``TOLERANCE`` of PP=1's, bf16 model values bit for bit."""
    one = pp_runs["run", option, (1, 1)][0]
    two = pp_runs["run", option, (2, 1)]
    assert len(two) == 2
    for r in [one, *two]:
        assert r["norms"] == pytest.approx(r["refs"], rel=1e-6), r
    assert two[0]["norms"] == two[1]["norms"]
    assert two[0]["refs"][0] == pytest.approx(one["refs"][0], rel=1e-12)
    assert two[0]["norms"] == pytest.approx(one["norms"], rel=TOLERANCE)
    assert set(merged(two, "end")) == set(one["end"]) == {"w1", "alpha", "w2", "sink"}
    mlp_stack.assert_close_normwise(merged(two, "end"), one["end"], "PP=2 vs PP=1")


def test_each_stage_holds_only_its_parameters_and_its_islands(pp_runs):
    """Stage 0 holds w1 and alpha (kept fp32 by the option: an fp32 main parameter and fp32
    Adam state, model value fp32), stage 1 holds w2 and sink."""
    two = pp_runs["run", True, (2, 1)]
    assert [set(r["end"]) for r in two] == [{"w1", "alpha"}, {"w2", "sink"}]
    assert two[0]["end"]["alpha"]["model"].dtype == torch.float32
    assert two[0]["end"]["w1"]["model"].dtype == BF16


RESHARDS = [((2, 1), (1, 1)), ((1, 1), (2, 1)), ((2, 2), (1, 2))]


@pytest.mark.parametrize(
    "saved,loaded", RESHARDS, ids=[f"pp{a}dp{b}-to-pp{c}dp{d}" for (a, b), (c, d) in RESHARDS]
)
def test_pp_resharded_load_continues_like_the_uninterrupted_run(pp_runs, saved, loaded):
    """Saved at one (PP, DP) shape with the option (fully_reshardable), loaded at another
    into a model built from other values: every parameter and Adam state tensor equals the
    saver's bit for bit, ``step`` included; two more steps equal the uninterrupted run at
    the new shape within ``TOLERANCE``, norms too, and within 1e-6 of fp64."""
    saver = merged(pp_runs["run", True, saved], "at_save")
    reference = pp_runs["run", True, loaded]
    runs = pp_runs["load", saved, FULL, loaded]
    assert len(runs) == len(reference) == loaded[0] * loaded[1]
    for r in runs:
        assert "error" not in r, r
    mlp_stack.assert_same(merged(runs, "loaded"), saver, "loaded")
    mlp_stack.assert_close_normwise(merged(runs, "end"), merged(reference, "end"), "continued")
    for r, u in zip(runs, reference, strict=True):
        assert r["norms"] == pytest.approx(u["norms"][SAVED_AT:], rel=TOLERANCE)
        assert r["norms"] == pytest.approx(r["refs"], rel=1e-6)


def test_pp_and_dp_together_train_as_pp_alone(pp_runs):
    """PP=2 x DP=2 (the same batch on every data-parallel rank): every step's norm within
    1e-6 of fp64 on every rank, norms and final state those of PP=2 at one data-parallel
    rank within ``TOLERANCE``; PP=1 x DP=2 likewise against PP=1."""
    for shape, alone in (((2, 2), (2, 1)), ((1, 2), (1, 1))):
        runs, one = pp_runs["run", True, shape], pp_runs["run", True, alone]
        assert len(runs) == shape[0] * shape[1]
        for r in runs:
            assert r["norms"] == pytest.approx(r["refs"], rel=1e-6), r
            assert r["norms"] == pytest.approx(one[0]["norms"], rel=TOLERANCE)
        mlp_stack.assert_close_normwise(merged(runs, "end"), merged(one, "end"), f"{shape}")


def test_dp_reshardable_does_not_reshard_pp(pp_runs):
    """megatron-core's ``dp_reshardable`` optimizer state is laid out per bucket of one
    model-parallel rank: saved at PP=2, loaded at PP=1 (where the bucket holds both stages'
    parameters), megatron-core refuses (a global shape mismatch of the bucket tensor), no
    wrong data. ``fully_reshardable`` reshards PP (above)."""
    (r,) = pp_runs["load", (2, 1), DP, (1, 1)]
    assert r.get("error", "").startswith("CheckpointException"), r
    assert "Global shape mismatch" in r["error"], r


def test_a_pp2_checkpoint_saved_without_the_option_loads_at_pp1_with_it(pp_runs):
    """Saved by stock megatron-core at PP=2 (``alpha`` natively fp32 there), loaded at
    PP=1 with the option (``alpha`` an fp32 island, its model value fp32 too): the same
    full state bit for bit, model values included, and the continuation equals the
    uninterrupted run with the option at PP=1 within ``TOLERANCE``."""
    saver = merged(pp_runs["run", False, (2, 1)], "at_save")
    (r,) = pp_runs["load", (2, 1), FULL, "off", (1, 1)]
    assert "error" not in r, r
    mlp_stack.assert_same(r["loaded"], saver, "loaded")
    reference = pp_runs["run", True, (1, 1)][0]
    mlp_stack.assert_close_normwise(r["end"], reference["end"], "continued")
    assert r["norms"] == pytest.approx(reference["norms"][SAVED_AT:], rel=TOLERANCE)
