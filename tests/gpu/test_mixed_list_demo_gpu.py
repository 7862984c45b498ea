"""The main job's first section on a GPU: stock megatron-core's real norm of the mixed list,
each order in its own process, next to ours and fp64.

With transformer-engine (or Apex) bound in megatron-core's clip_grads, stock must be wrong on
bf16-first as the emulated read predicts (0.2165 on the H200) and wrong or dead on
fp32-first; on megatron-core's per-tensor fallback it must be right, and the output must say
that the kernel bug cannot be shown there. Ours is 0.25 in both orders either way.
Run on the GPU machine: ``pytest -m cuda tests/gpu/test_mixed_list_demo_gpu.py``.
"""

import importlib.util

import pytest
import torch

from megatron_ext import mixed_list_demo as demo

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_stock_ours_and_fp64_on_both_orders():
    stock = demo.stock_results()
    kernels = {s.kernel for s in stock.values()}
    assert len(kernels) == 1 and "unknown" not in kernels, stock
    cuda = torch.device("cuda")
    for order in demo.ORDERS:
        assert demo.ours_norm(demo.make_list(order, cuda)) == pytest.approx(0.25, rel=1e-6)
    lines = demo.report(cuda, importlib.util.find_spec("transformer_engine") is not None, stock)
    text = "\n".join(lines)
    print(text)  # the record for docs/gpu-test-log.md
    fwd, rev = stock["bf16,fp32"], stock["fp32,bf16"]
    if fwd.fallback:
        # one torch.norm per tensor, the bf16 one's result rounded to bf16: 0.249987 on the
        # H200 (run 50); right to bf16 precision, unlike the fused kernel's 0.2165
        assert fwd.norm == pytest.approx(0.25, rel=1e-3) and rev.norm == pytest.approx(
            0.25, rel=1e-3
        )
        assert "cannot be shown" in text
    else:
        emulated = demo.emulate_first_dtype_read(demo.make_list("bf16,fp32", cuda)).norm
        assert fwd.norm == pytest.approx(emulated, rel=1e-3), fwd
        assert rev.failure is not None or abs(rev.norm - 0.25) > 1e-3, rev
        assert "cannot be shown" not in text
