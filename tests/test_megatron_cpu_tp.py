"""Tensor parallelism with the option, on the CPU: megatron-core's ``ColumnParallelLinear``,
DDP, distributed optimizer and ``dist_checkpointing`` (torch_dist) through
``tests/support/cpu_megatron.py``, at TP=1 and TP=2 (one data-parallel rank).

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
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from tests import test_megatron_cpu_reshard as reshard
from tests.test_megatron_cpu import BF16, CLIP, LR, F, H, batch, owned_state, run_ranks

pytest.importorskip("megatron.core")

SAVED_AT, STEPS = 2, 4
FULL, DP = "fully_reshardable", "dp_reshardable"
TOLERANCE = reshard.TOLERANCE  # as at another DP size: only the norm's sum order differs


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
    model = megatron_ext.DistributedDataParallel(tcfg, ddp_config, TPMLP())
    ocfg = OptimizerConfig(
        optimizer="adam", lr=LR, clip_grad=CLIP, bf16=True, use_distributed_optimizer=True
    )
    return model, megatron_ext.get_megatron_optimizer(ocfg, [model])


def fp64_norm(model) -> float:
    """The gradient norm in fp64 from the reduced gradients in the buffers: ``fc1``'s
    shards summed over the TP ranks, each replicated parameter once."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    sharded = torch.zeros((), dtype=torch.float64)
    replicated = 0.0
    for p in model.module.parameters():
        sq = p.main_grad.double().square().sum()
        if getattr(p, "tensor_model_parallel", False):
            sharded += sq
        else:
            replicated += sq.item()
    dist.all_reduce(sharded, group=ps.get_tensor_model_parallel_group())
    return math.sqrt(sharded.item() + replicated)


def train(model, opt, steps) -> tuple[list[float], list[float]]:
    """Clipped steps on ``batch(0, s)`` (every TP rank the same data); norms and their
    fp64 references."""
    norms, refs = [], []
    for s in steps:
        model.zero_grad_buffer()
        opt.zero_grad()
        model(*batch(0, s)).backward()
        model.finish_grad_sync()
        refs.append(fp64_norm(model))
        ok, norm, _ = opt.step()
        assert ok
        norms.append(float(norm))
    return norms, refs


def full_state(model, opt) -> dict[str, dict[str, torch.Tensor]]:
    """Per parameter name: its full main value and Adam state (``fc1``'s TP shards
    gathered and joined along the split dimension), and its model value."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    group = ps.get_tensor_model_parallel_group()
    params = dict(model.module.named_parameters())
    out = {}
    for (name, lo, hi), entry in owned_state(model, opt).items():
        p = params[name]
        assert (lo, hi) == (0, p.numel()), name  # one data-parallel rank owns everything
        full = {k: v for k, v in entry.items() if k == "step"}
        tensors = {k: v.reshape(p.shape) for k, v in entry.items() if k != "step"}
        tensors["model"] = p.detach().clone()
        for k, v in tensors.items():
            if getattr(p, "tensor_model_parallel", False) and dist.get_world_size(group) > 1:
                parts = [torch.empty_like(v) for _ in range(dist.get_world_size(group))]
                dist.all_gather(parts, v.contiguous(), group=group)
                v = torch.cat(parts, dim=p.partition_dim)
            full[k] = v
        out[name] = full
    return out


def ckpt(out_dir: str, tp: int, fmt: str) -> str:
    return os.path.join(out_dir, f"ckpt-tp{tp}-{fmt}")


def tp_job(rank, world, log, out_dir, plan):
    """At TP=``world``: per option in ``plan["run"]``, STEPS steps (the option's saved at
    SAVED_AT in each format of ``plan["save"]``); then per (saved TP, format) in
    ``plan["load"]``, a model built from other values loads that checkpoint and continues
    to STEPS (an exception is the result)."""
    from torch.distributed.checkpoint.api import CheckpointException

    out = {}
    for option in plan["run"]:
        model, opt = build(option, world)
        norms, refs = train(model, opt, range(SAVED_AT))
        at_save = full_state(model, opt)
        if option:
            for fmt in plan["save"]:
                reshard.save(model, opt, ckpt(out_dir, world, fmt), fmt)
        more = train(model, opt, range(SAVED_AT, STEPS))
        out["run", option] = dict(norms=norms + more[0], refs=refs + more[1], at_save=at_save,
                                  end=full_state(model, opt))  # fmt: skip
    for saved_tp, fmt in plan["load"]:
        model, opt = build(True, world, seed=12)
        try:
            reshard.load(model, opt, ckpt(out_dir, saved_tp, fmt), fmt)
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - the result
            # torch's CheckpointException derives from BaseException, not Exception
            out["load", saved_tp, fmt] = dict(error=f"{type(e).__name__}: {str(e)[-1500:]}")
            continue
        state = full_state(model, opt)
        norms, refs = train(model, opt, range(SAVED_AT, STEPS))
        out["load", saved_tp, fmt] = dict(loaded=state, end=full_state(model, opt), norms=norms,
                                          refs=refs)  # fmt: skip
    return out


# TP=2 saves in both formats; TP=1 saves, and loads both; TP=2 loads TP=1's (a second spawn
# at TP=2). A load that fails at TP=2 could leave one rank waiting for the other, so only
# the format that loads at TP=1 is loaded there.
PLANS = [
    (2, dict(run=[True, False], save=[FULL, DP], load=[])),
    (1, dict(run=[True, False], save=[FULL], load=[(2, FULL), (2, DP)])),
    (2, dict(run=[], save=[], load=[(1, FULL)])),
]


@pytest.fixture(scope="module")
def tp_runs(tmp_path_factory):
    """Every rank's results, keyed by (what, ..., TP size)."""
    tmp_path = tmp_path_factory.mktemp("tp")
    out: dict = {}
    for world, plan in PLANS:
        for result in run_ranks(tmp_path, world, tp_job, plan):
            for key, value in result.items():
                out.setdefault(key + (world,), []).append(value)
    return out


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("option", [True, False], ids=["on", "off"])
def test_norm_counts_shards_once_each_and_replicas_once(tp_runs, tp, option):
    """Every step's norm within 1e-6 of the fp64 norm of the buffers' gradients, on every
    TP rank. The same gradients at TP=1 and TP=2 where the values are the same: the first
    two steps' fp64 norms agree to 1e-12 (the model's TP split is exact; the first clip
    coefficient rounds alike); later the parameters differ by the clip coefficients' fp32
    rounding, so the norms agree to 1e-6."""
    for r in tp_runs["run", option, tp]:
        assert r["norms"] == pytest.approx(r["refs"], rel=1e-6), r
    one, two = tp_runs["run", option, 1][0], tp_runs["run", option, 2][0]
    assert one["refs"][:2] == pytest.approx(two["refs"][:2], rel=1e-12)
    assert one["refs"] == pytest.approx(two["refs"], rel=1e-6)


def assert_close_normwise(got: dict, want: dict, what: str) -> None:
    """Within ``TOLERANCE`` normwise per tensor; bf16 model values bit for bit."""
    reshard.assert_close_normwise(got, want, what)
    for name, entry in want.items():
        if entry["model"].dtype == BF16:
            assert torch.equal(got[name]["model"], entry["model"]), (what, name)


@pytest.mark.parametrize("saved_tp,fmt", [(2, FULL), (1, FULL)], ids=["tp2-to-tp1", "tp1-to-tp2"])
def test_tp_resharded_load_continues_like_the_uninterrupted_run(tp_runs, saved_tp, fmt):
    """Saved at one TP size with the option, loaded at the other into a model built from
    other values: every full parameter and Adam state tensor (shards joined) equals the
    saver's bit for bit on every rank, ``step`` included; two more steps equal the
    uninterrupted run at the new size within ``TOLERANCE``, norms too."""
    tp = 3 - saved_tp
    saver = tp_runs["run", True, saved_tp][0]
    reference = tp_runs["run", True, tp]
    runs = tp_runs["load", saved_tp, fmt, tp]
    assert len(runs) == tp
    for r, u in zip(runs, reference, strict=True):
        assert "error" not in r, r
        reshard.assert_same(r["loaded"], saver["at_save"], "loaded")
        assert_close_normwise(r["end"], u["end"], "continued")
        assert r["norms"] == pytest.approx(u["norms"][SAVED_AT:], rel=TOLERANCE)
        assert r["norms"] == pytest.approx(r["refs"], rel=1e-6)


def test_dp_reshardable_does_not_reshard_tp(tp_runs):
    """megatron-core's ``dp_reshardable`` optimizer state is laid out per data-parallel
    bucket of one TP rank: saved at TP=2, loaded at TP=1, megatron-core refuses (a global
    shape mismatch of the bucket tensor), no wrong data. ``fully_reshardable`` reshards
    TP (above)."""
    (r,) = tp_runs["load", 2, DP, 1]
    assert r.get("error", "").startswith("CheckpointException"), r
    assert "Global shape mismatch" in r["error"], r
