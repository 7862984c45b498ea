"""Adam moments kept in bf16 by the chunked offload step (megatron-core's exp_avg_dtype and
exp_avg_sq_dtype with the precision-aware optimizer, each in its own dtype), on the CPU.

Oracle, per step and from the step's own inputs (so that rounding does not compound): the
AdamW update in fp64 from the moments widened, each moment then rounded to its dtype as a
GPU kernel storing it does.

Tolerances. Parameters: the fused kernel computes in fp32, a few roundings of relative size
2^-24 on the update, so rtol 1e-6 and an atol of 1e-6 x lr. Moments: fp32 and fp64 agree
to a few fp32 units before the rounding to bf16 (8 significant bits), so the rounded values
are equal except where the exact value lies within those few units of a halfway point
between two bf16 numbers: a fraction of about 2^-13 of the elements, each one bf16 unit
off. Allowed: at most 0.1% of the elements, none by more than one unit. A moment kept in
fp32: a few fp32 roundings of its two terms, 1e-6 of their magnitudes.
"""

from __future__ import annotations

import types
import warnings

import pytest
import torch

from buffers.spans import Span
from megatron_ext.offload.moment_dtypes import offload_moment_dtypes
from megatron_ext.offload.step import ChunkedAdamW, HostParam, chunk_spans
from tests.support import offload_internals
from tests.support.offload_sim import (
    MirrorChunked,
    train,
    train_switching,
)

pytestmark = pytest.mark.mcore

BF16, FP32 = torch.bfloat16, torch.float32
# exp_avg's and exp_avg_sq's dtypes
MOMENTS = {"bf16": (BF16, BF16), "bf16_fp32": (BF16, FP32), "fp32_bf16": (FP32, BF16)}
LR, BETAS, EPS, WD = 3e-3, (0.9, 0.95), 1e-8, 0.1


def _ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many bf16 units two bf16 tensors of the same signs are apart."""
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()


def _stepper(sizes, chunk, compute, gen, moments=(BF16, BF16), kernel="auto"):
    n, entries, start = 0, [], []
    for size in sizes:
        start.append(n)
        n += size + 5  # padding between parameters, as in a mirror
    host = torch.randn(n, generator=gen)
    for at, size in zip(start, sizes, strict=True):
        data = host[at : at + size]
        opt = torch.optim.AdamW([data], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, fused=True)
        entries.append(HostParam(data, Span(at, at + size), opt, 0, family=0))
    runs = chunk_spans([Span(0, n)], chunk, [e.local for e in entries])
    grads = torch.zeros(n)
    stepper = ChunkedAdamW(
        host, grads, entries, [r for _, r in runs], compute, moment_dtypes=moments, kernel=kernel
    )
    return host, grads, stepper


@pytest.mark.parametrize("kernel", ["torch", "native"])
@pytest.mark.parametrize("moments", MOMENTS)
@pytest.mark.parametrize("chunk,compute", [(10**9, 10**9), (300, 64), (1, 1)])
def test_narrow_moments_follow_adamw_in_fp64_rounded_to_their_dtypes(
    chunk, compute, moments, kernel
):
    dtypes = MOMENTS[moments]
    gen = torch.Generator().manual_seed(4)
    host, grads, stepper = _stepper([700, 64, 1, 333], chunk, compute, gen, dtypes, kernel)
    flips = total = 0
    for t in range(1, 6):
        # values bf16 cannot hold, over several magnitudes
        grads.copy_(torch.randn(grads.numel(), generator=gen) * 10 ** torch.randint(-3, 3, (1,)))
        p0 = host.double().clone()
        m0 = stepper.exp_avg.double() if stepper.exp_avg is not None else torch.zeros_like(p0)
        v0 = stepper.exp_avg_sq.double() if stepper.exp_avg is not None else torch.zeros_like(p0)
        stepper.begin()
        for c in range(len(stepper.chunks)):
            stepper.update(c)
        stepper.finish()
        assert stepper.uses_native is (kernel == "native")
        g = grads.double()
        terms = (
            (BETAS[0] * m0, (1 - BETAS[0]) * g),  # exp_avg's two terms
            (BETAS[1] * v0, (1 - BETAS[1]) * g * g),
        )
        m1, v1 = (a + b for a, b in terms)
        p1 = p0 * (1 - LR * WD) - LR * (m1 / (1 - BETAS[0] ** t)) / (
            (v1 / (1 - BETAS[1] ** t)).sqrt() + EPS
        )
        assert (stepper.exp_avg.dtype, stepper.exp_avg_sq.dtype) == dtypes
        for e in stepper.entries:
            s = slice(e.local.start, e.local.end)
            torch.testing.assert_close(host[s].double(), p1[s], rtol=1e-6, atol=LR * 1e-6)
            for mine, exact, (a, b), dtype in zip(
                (stepper.exp_avg, stepper.exp_avg_sq), (m1, v1), terms, dtypes, strict=True
            ):
                if dtype == BF16:
                    apart = _ulps_apart(mine[s], exact[s].to(BF16))
                    assert int(apart.max()) <= 1
                    flips += int(apart.sum())
                    total += apart.numel()
                else:
                    off = (mine[s].double() - exact[s]).abs()
                    assert bool((off <= 1e-6 * (a[s].abs() + b[s].abs())).all())
            state = e.optimizer.state[e.param]
            assert (state["exp_avg"].dtype, state["exp_avg_sq"].dtype) == dtypes
            assert float(state["step"]) == t
    assert total > 0 and flips <= total // 1000, (flips, total)


class _Bf16Moments(MirrorChunked):
    moment_dtypes = (BF16, BF16)


def test_bf16_moments_halve_the_moment_bytes_and_survive_a_checkpoint(cpu_streams):
    fp32 = train(MirrorChunked, True, 1.0, 2, chunk=200, compute=64)[2]
    bf16 = train(_Bf16Moments, True, 1.0, 2, chunk=200, compute=64)[2]
    for wide, narrow in zip(fp32.host_mirror_stats(), bf16.host_mirror_stats(), strict=True):
        assert narrow["moment_dtypes"] == (BF16, BF16)
        assert 2 * narrow["moment_bytes"] == wide["moment_bytes"] > 0
    for state in bf16.state.values():
        if "exp_avg" in state and state["exp_avg"].device.type == "cpu":
            assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == BF16
    plain = train(_Bf16Moments, True, 0.5, 5, chunk=200, compute=64)
    resumed = train_switching(_Bf16Moments, _Bf16Moments, True, 0.5, 5, switch_at=2)
    assert torch.equal(plain[0].param_data, resumed[0].param_data)
    assert torch.equal(plain[1].param_data, resumed[1].param_data)
    a = [p for g in plain[2].param_groups for p in g["params"]]
    b = [p for g in resumed[2].param_groups for p in g["params"]]
    for pa, pb in zip(a, b, strict=True):
        for key in ("exp_avg", "exp_avg_sq"):
            x, y = plain[2].state[pa][key], resumed[2].state[pb][key]
            assert x.dtype == y.dtype and torch.equal(x, y)


@pytest.mark.parametrize("moments", ["bf16_fp32", "fp32_bf16"])
def test_moments_in_two_dtypes_through_the_offload_optimizer(cpu_streams, moments):
    """exp_avg in one dtype and exp_avg_sq in another, as megatron-core's config allows:
    each kept in its own (the state, the host bytes). Each moment depends on the gradients
    alone, so the one kept in fp32 equals an all-fp32 run's bit for bit, and the bf16 one
    follows it to bf16's precision."""
    dtypes = MOMENTS[moments]

    class Mixed(MirrorChunked):
        moment_dtypes = dtypes

    fp32 = train(MirrorChunked, True, 1.0, 3, chunk=200, compute=64)[2]
    mixed = train(Mixed, True, 1.0, 3, chunk=200, compute=64)[2]
    for wide, row in zip(fp32.host_mirror_stats(), mixed.host_mirror_stats(), strict=True):
        assert row["moment_dtypes"] == dtypes
        assert 4 * row["moment_bytes"] == 3 * wide["moment_bytes"] > 0  # 2 + 4 bytes, not 8
    a = [p for g in fp32.param_groups for p in g["params"]]
    b = [p for g in mixed.param_groups for p in g["params"]]
    offloaded = 0
    for x, y in zip(a, b, strict=True):
        for key, dtype in zip(("exp_avg", "exp_avg_sq"), dtypes, strict=True):
            wide, mine = fp32.state[x][key], mixed.state[y][key]
            assert mine.dtype == dtype, key
            if dtype == FP32:
                assert torch.equal(mine, wide), key
            else:
                torch.testing.assert_close(mine.float(), wide, rtol=2**-6, atol=1e-3)
                assert not torch.equal(mine.float(), wide)
        offloaded += 1
    assert offloaded == len(mixed.gpu_params_map_cpu_copy) > 0


def _config(**kw):
    base = dict(
        use_precision_aware_optimizer=True,
        exp_avg_dtype=torch.float32,
        exp_avg_sq_dtype=torch.float32,
        main_params_dtype=torch.float32,
    )
    return types.SimpleNamespace(**(base | kw))


def test_the_moment_dtypes_come_from_megatron_cores_config():
    bf = dict(exp_avg_dtype=BF16, exp_avg_sq_dtype=BF16)
    assert offload_moment_dtypes(_config(**bf), True) == (BF16, BF16)
    assert offload_moment_dtypes(_config(exp_avg_sq_dtype=BF16), True) == (torch.float32, BF16)
    not_pa = _config(use_precision_aware_optimizer=False, **bf)
    assert offload_moment_dtypes(not_pa, True) == (torch.float32, torch.float32)
    with pytest.warns(UserWarning, match="not honoured by the per-parameter .*offload_step="):
        assert offload_moment_dtypes(_config(**bf), False) == (torch.float32, torch.float32)
    with pytest.warns(UserWarning, match="main_params_dtype=torch.float16 is not honoured"):
        offload_moment_dtypes(_config(main_params_dtype=torch.float16), True)
    with pytest.raises(ValueError, match="not torch.float16 .*exp_avg_dtype"):
        offload_moment_dtypes(_config(exp_avg_dtype=torch.float16), True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        offload_moment_dtypes(_config(), False)  # fp32 everywhere: nothing to say


def test_a_chunked_step_that_falls_back_says_the_moments_stay_fp32(cpu_streams):
    not_fused = offload_internals.cpu_adamw_not_fused(_Bf16Moments)
    with pytest.warns(UserWarning, match="not fused.*moments in fp32"):
        hdo = train(not_fused, True, 1.0, 2, chunk=200, compute=64)[2]
    assert all(s["exp_avg"].dtype == torch.float32 for s in hdo.state.values())


def test_attach_keeps_the_moments_megatron_cores_config_asks_for(cpu_streams):
    from megatron_ext import offload
    from tests.support.offload_sim import distopt_shaped

    child = distopt_shaped(True, 2, 1)
    child.config.use_precision_aware_optimizer = True
    child.config.exp_avg_dtype = child.config.exp_avg_sq_dtype = BF16
    assert offload.attach_host_mirrors(child, chunked_step=True, chunk_numel=64)
    hdo = child.optimizer
    for buf in child.buffers:
        buf.grad_data.normal_(generator=torch.Generator().manual_seed(2))
    for t in offload_internals.flat_targets(child):
        for dst, src in t.copies:
            dst.copy_(src)
    hdo.step()
    assert offload_internals.chunked(hdo) is not None
    cpu = [hdo.state[p] for p in hdo.gpu_params_map_cpu_copy]
    assert cpu and all(s["exp_avg"].dtype == s["exp_avg_sq"].dtype == BF16 for s in cpu)
