"""Tensor parallelism with the option, on the CPU: megatron-core's ``ColumnParallelLinear``,
DDP, distributed optimizer and ``dist_checkpointing`` (torch_dist) through
``tests/support/cpu_megatron.py``, at TP=1 and TP=2, with one data-parallel rank and
with two (TP=2 x DP=2 at four ranks).

The model: ``fc1``, a bf16 ``ColumnParallelLinear`` (weight and bias split by output rows
across TP ranks, output gathered), ReLU, then ``w2`` (bf16, replicated on every TP rank),
an fp32 island ``alpha`` (a bf16 parameter marked ``keep_in_fp32``; natively fp32 without
the option) and a natively fp32 ``sink``, both replicated. Weights are initialised on the
CPU from the full matrix (``use_cpu_initialization``), so TP=1 and TP=2 start from the same
values. The column split makes TP exact: each output row of ``fc1`` and its weight
gradient are computed from the same full inputs at either size, and the gathered output
feeds the replicated rest, so the gradients are the same bits at TP=1 and TP=2 (checked:
the norms agree within the fp32 sum order). What changes with TP is which rank holds which
rows of ``fc1`` and its optimizer state, and that the norm must count ``fc1``'s shards on
every rank but the replicated parameters once.

Oracles: the step's gradient norm against an fp64 norm of the gradients in the buffers
(shards summed over the TP ranks, replicated parameters counted once), option on and off;
a checkpoint saved at one TP size and loaded at the other holds every full parameter and
optimizer state tensor of the saver, bit for bit (TP shards joined along their split
dimension); the continuation equals the uninterrupted run at the new size within
``TOLERANCE`` (the norm's sum order), bf16 parameters bit for bit.

With ``MEGATRON_TEST_DEVICE=cuda`` the same file runs on GPU 0, every rank on it over gloo
(``scripts/gpu_session.sh reshard``; as ``tests/test_megatron_cpu_reshard.py``).
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.support import mlp_stack
from tests.support.megatron_mlp import BF16, CLIP, LR, F, H, batch, owned_pieces
from tests.support.megatron_ranks import rank_device, skip_unless_the_device_serves, to_model
from tests.support.reshard_plans import SAVED_AT, run_plan, runs_by_shape

pytestmark = pytest.mark.mcore

pytest.importorskip("megatron.core")
skip_unless_the_device_serves()

FULL, DP = "fully_reshardable", "dp_reshardable"
TOLERANCE = mlp_stack.TOLERANCE  # as at another DP size: only the norm's sum order differs


def build(option: bool, tp: int, seed: int = 11):
    """Parallel state at TP=``tp``, the model (module docstring), DDP and the distributed
    optimizer (Adam, clipped)."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer.module import MegatronModule
    from megatron.core.transformer.transformer_config import TransformerConfig

    import megatron_ext

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    torch.manual_seed(seed)  # fc1's full CPU-initialised matrix, then split
    tcfg = TransformerConfig(
        num_layers=1, hidden_size=H, num_attention_heads=4, bf16=True, params_dtype=BF16,
        use_cpu_initialization=True, tensor_model_parallel_size=tp,
    )  # fmt: skip

    def init(w):
        return torch.nn.init.normal_(w, std=0.3)

    class TPMLP(MegatronModule):
        def __init__(self):
            super().__init__(tcfg)
            self.fc1 = tensor_parallel.ColumnParallelLinear(
                H, F, config=tcfg, init_method=init, bias=True, gather_output=True
            )
            g = torch.Generator().manual_seed(seed + 1)
            self.w2 = torch.nn.Parameter((torch.randn(H, F, generator=g) * 0.3).to(BF16))
            alpha = torch.randn(H, generator=g).to(BF16)
            self.alpha = torch.nn.Parameter(alpha if option else alpha.float())
            self.sink = torch.nn.Parameter(torch.randn(H, generator=g))
            if option:
                megatron_ext.mark_keep_in_fp32(self.alpha)

        def forward(self, x, t):
            h, _ = self.fc1(x)
            y = (torch.relu(h) @ self.w2.t()).float() * self.alpha.float() + self.sink
            return ((y - t) ** 2).sum() / x.shape[0]

    ddp_config = megatron_ext.DistributedDataParallelConfig(
        per_dtype_grad_buffers=option, use_distributed_optimizer=True
    )
    module = TPMLP().to(rank_device())  # megatron-core's buffers are made on its device
    model = megatron_ext.DistributedDataParallel(tcfg, ddp_config, module)
    ocfg = OptimizerConfig(
        optimizer="adam", lr=LR, clip_grad=CLIP, bf16=True, use_distributed_optimizer=True
    )
    return model, megatron_ext.get_megatron_optimizer(ocfg, [model])


def fp64_norm(model) -> float:
    """The gradient norm in fp64 from the reduced gradients in the buffers, over the
    ranges each data-parallel rank owns (megatron-core's own range map: outside them a
    buffer holds this rank's unreduced share) summed over the data-parallel group;
    ``fc1``'s shards then summed over the TP ranks, each replicated parameter once."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    params = dict(model.module.named_parameters())
    sums = torch.zeros(2, dtype=torch.float64)  # [TP-sharded, replicated over TP]
    for name, _, _, piece in owned_pieces(model):
        sharded = getattr(params[name], "tensor_model_parallel", False)
        sums[0 if sharded else 1] += piece.double().square().sum().cpu()
    dist.all_reduce(sums, group=ps.get_data_parallel_group())
    sharded = sums[:1].clone()
    dist.all_reduce(sharded, group=ps.get_tensor_model_parallel_group())
    return math.sqrt(sharded.item() + sums[1].item())


def train(model, opt, steps) -> tuple[list[float], list[float]]:
    """Clipped steps on ``batch(0, s)`` (every TP rank the same data); norms and their
    fp64 references."""
    norms, refs = [], []
    for s in steps:
        model.zero_grad_buffer()
        opt.zero_grad()
        model(*to_model(model, *batch(0, s))).backward()
        model.finish_grad_sync()
        refs.append(fp64_norm(model))
        ok, norm, _ = opt.step()
        assert ok
        norms.append(float(norm))
    return norms, refs


def tp_job(rank, world, log, out_dir, plan):
    """At TP=``plan["tp"]`` (data-parallel size ``world`` / TP): :func:`run_plan`."""
    tp = plan["tp"]

    def make(option, seed):
        model, opt = build(option, tp, seed)
        return model, opt, lambda steps: train(model, opt, steps)

    return run_plan(plan, (tp, world // tp), out_dir, make)


# (world, plan); shapes are (TP, DP). TP=2 saves in both formats; TP=1 saves, and loads
# both; TP=2 loads TP=1's (a second spawn at TP=2). A load that fails at TP=2 could leave
# one rank waiting for the other, so only the format that loads at TP=1 is loaded there.
# TP and DP together: TP=2 x DP=2 (four ranks) saves and loads TP=1's; TP=1 x DP=2 and
# TP=2 x DP=1 load it. Every rank trains on the same batches, so the data-parallel mean
# is the same gradient at every DP size.
PLANS = [
    (2, dict(tp=2, run=[True, False], save=[FULL, DP], load=[])),
    (1, dict(tp=1, run=[True, False], save=[FULL], load=[((2, 1), FULL), ((2, 1), DP)])),
    (4, dict(tp=2, run=[True], save=[FULL], load=[((1, 1), FULL)])),
    (2, dict(tp=2, run=[], save=[], load=[((1, 1), FULL), ((2, 2), FULL)])),
    (2, dict(tp=1, run=[True], save=[], load=[((2, 2), FULL)])),
]


@pytest.fixture(scope="module")
def tp_runs(tmp_path_factory):
    """Every rank's results, keyed by (what, ..., (TP, DP))."""
    return runs_by_shape(tmp_path_factory.mktemp("tp"), tp_job, PLANS, "tp")


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("option", [True, False], ids=["on", "off"])
def test_norm_counts_shards_once_each_and_replicas_once(tp_runs, tp, option):
    """Every step's norm within 1e-6 of the fp64 norm of the buffers' gradients, on every
    TP rank. The same gradients at TP=1 and TP=2 where the values are the same: the first
    two steps' fp64 norms agree to 1e-12 (the model's TP split is exact; the first clip
    coefficient rounds alike); later the parameters differ by the clip coefficients' fp32
    rounding, so the norms agree to 1e-6."""
    for r in tp_runs["run", option, (tp, 1)]:
        assert r["norms"] == pytest.approx(r["refs"], rel=1e-6), r
    one, two = tp_runs["run", option, (1, 1)][0], tp_runs["run", option, (2, 1)][0]
    assert one["refs"][:2] == pytest.approx(two["refs"][:2], rel=1e-12)
    assert one["refs"] == pytest.approx(two["refs"], rel=1e-6)


def assert_close_normwise(got: dict, want: dict, what: str) -> None:
    """Within ``TOLERANCE`` normwise per tensor; bf16 model values bit for bit."""
    mlp_stack.assert_close_normwise(got, want, what)
    for name, entry in want.items():
        if entry["model"].dtype == BF16:
            assert torch.equal(got[name]["model"], entry["model"]), (what, name)


RESHARDS = [((2, 1), (1, 1)), ((1, 1), (2, 1)), ((2, 2), (1, 2)), ((2, 2), (2, 1)),
            ((1, 1), (2, 2))]  # fmt: skip


@pytest.mark.parametrize(
    "saved,loaded", RESHARDS, ids=[f"tp{a}dp{b}-to-tp{c}dp{d}" for (a, b), (c, d) in RESHARDS]
)
def test_tp_resharded_load_continues_like_the_uninterrupted_run(tp_runs, saved, loaded):
    """Saved at one (TP, DP) shape with the option, loaded at another into a model built
    from other values: every full parameter and Adam state tensor (shards joined) equals
    the saver's bit for bit on every rank, ``step`` included; two more steps equal the
    uninterrupted run at the new shape within ``TOLERANCE``, norms too."""
    saver = tp_runs["run", True, saved][0]
    reference = tp_runs["run", True, loaded]
    runs = tp_runs["load", saved, FULL, loaded]
    assert len(runs) == len(reference) == loaded[0] * loaded[1]
    for r, u in zip(runs, reference, strict=True):
        assert "error" not in r, r
        mlp_stack.assert_same(r["loaded"], saver["at_save"], "loaded")
        assert_close_normwise(r["end"], u["end"], "continued")
        assert r["norms"] == pytest.approx(u["norms"][SAVED_AT:], rel=TOLERANCE)
        assert r["norms"] == pytest.approx(r["refs"], rel=1e-6)


def test_tp_and_dp_together_train_as_each_alone(tp_runs):
    """TP=2 x DP=2 and TP=1 x DP=2 (the same batches on every rank): every step's norm
    within 1e-6 of fp64 on every rank, and the norms and final state those of TP=2 and
    TP=1 at one data-parallel rank within ``TOLERANCE`` (the data-parallel mean of equal
    gradients is the same gradient; what changes is which rank owns which state)."""
    for shape, alone in (((2, 2), (2, 1)), ((1, 2), (1, 1))):
        runs, one = tp_runs["run", True, shape], tp_runs["run", True, alone][0]
        assert len(runs) == shape[0] * shape[1]
        for r in runs:
            assert r["norms"] == pytest.approx(r["refs"], rel=1e-6), r
            assert r["norms"] == pytest.approx(one["norms"], rel=TOLERANCE)
            assert_close_normwise(r["end"], one["end"], f"{shape} vs {alone}")


def test_dp_reshardable_does_not_reshard_tp(tp_runs):
    """megatron-core's ``dp_reshardable`` optimizer state is laid out per data-parallel
    bucket of one TP rank: saved at TP=2, loaded at TP=1, megatron-core refuses (a global
    shape mismatch of the bucket tensor), no wrong data. ``fully_reshardable`` reshards
    TP (above)."""
    (r,) = tp_runs["load", (2, 1), DP, (1, 1)]
    assert r.get("error", "").startswith("CheckpointException"), r
    assert "Global shape mismatch" in r["error"], r
