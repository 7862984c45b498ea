"""The delayed offloaded update on the GPU, real streams and a real host worker beside the
next forward and backward: megatron-core's stack with ``offload_delayed_update`` lands, at
each step, exactly the parameters the exact chunked step had one step before, fed the same
gradients (computed by the delayed run's own forward and backward); a drain lands the last.
Compared bit for bit: the parameter buffers after every step, then the optimizer state."""

from __future__ import annotations

import pytest
import torch

from tests.support.gpu_offload_stack import assert_same, build, copy_grads, make_grads

pytestmark = pytest.mark.cuda


@pytest.fixture(autouse=True)
def _world(megatron_world):
    """Every test here runs inside the test process's one-rank NCCL world (conftest.py)."""


def params(model) -> list[torch.Tensor]:
    return [b.param_data.clone() for b in model.all_grad_buffers()]


@pytest.mark.parametrize("drained", [True, False], ids=["drained", "back_to_back"])
@pytest.mark.parametrize("pa", [True, False], ids=["pa", "main"])
def test_delayed_update_lands_the_exact_update_one_step_late(pa, drained):
    """``back_to_back``: no device-wide drain between steps, so the next zeroing of the
    gradient buffer follows the step at once (the copies to the host must be ordered
    before it by the streams alone)."""
    import megatron_ext

    ours = build(fraction=1.0, pa=pa, overlap=True, offload_step="chunked", delayed=True)
    ref = build(fraction=1.0, pa=pa, overlap=True, offload_step="chunked")
    before = params(ref[0])
    for step in range(6):
        make_grads(*ours, step)  # reads the parameters the delayed run holds
        copy_grads(ours[0], *ref)
        ok, norm, _ = ours[1].step()
        ref_ok, ref_norm, _ = ref[1].step()
        assert ok and ref_ok and torch.equal(norm, ref_norm), step
        if drained:
            torch.cuda.synchronize()
        for a, b in zip(params(ours[0]), before, strict=True):
            assert torch.equal(a, b), f"step {step}: not the exact run's previous parameters"
        before = params(ref[0])
    assert megatron_ext.drain_offload(ours[1]) == len(ours[1].chained_optimizers)
    torch.cuda.synchronize()
    assert_same(ours, ref, "drained")
