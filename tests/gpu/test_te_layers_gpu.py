"""A GPTModel with transformer-engine's layer spec, TE's weight gradients fused into
``main_grad``, per-dtype gradient buffers against stock megatron-core, at 1 and 2 ranks.

Cells (``te_layers_worker.cells()``): the distributed optimizer, precision-aware (TE's
FusedAdam), precision-aware with CPU offload at fractions 1.0 and 0.5 (megatron-core's
per-parameter step and ours chunked), fp16 with a dynamic loss scale; fp32 islands (a
per-layer vector kept in fp32) on and off; 1 and 2 micro-batches at one rank, 2 at two
ranks (gloo on the one GPU, ``tests/support/multirank``). Each arm runs in processes of its
own (``te_layers_driver.launch``): a stock cell that kills its process is a ``crashed`` row
and the cells after it run in a fresh one.

Checked per cell (``te_layers_driver.judge``): ours' norm within 1e-6 of an fp64 norm of
megatron-core's reduced gradient buffers on every step (``megatron_lm_launcher.
reference_norm``), clipping active, every step taken, every TE weight's gradient
accumulated by TE into ``main_grad``, a bf16/fp16 buffer plus an fp32 one with islands on;
stock as expected: where it runs and its norm is right (within 1e-6 of fp64), the same
gradients at the first step and parameters after the steps equal to ours' within one unit
in the last place of their dtype (``PARAM_RTOL``) plus 1e-6; where it fails, the failure
it is known for (a non-finite norm on every step with precision-aware and islands, "can't
optimize a non-leaf Tensor" at construction with offload and islands), asserted and kept
as a row. The table is printed, and with ``TE_LAYERS_OUT`` set written there with the rows
as JSON (``scripts/gpu_session.sh te_layers``).
"""

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import te_layers_driver as w  # noqa: E402

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(
        importlib.util.find_spec("transformer_engine") is None,
        reason="needs transformer-engine (scripts/gpu_session.sh te installs it)",
    ),
]

CELLS = w.cells()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Both arms of every cell, judged (``te_layers_driver.run_all``); the table printed and
    (TE_LAYERS_OUT) saved."""
    out = Path(os.environ.get("TE_LAYERS_OUT") or tmp_path_factory.mktemp("te_layers"))
    judged, text = w.run_all(CELLS, out, float(os.environ.get("TE_LAYERS_TIMEOUT", "400")))
    print("\n" + text)
    return judged


@pytest.mark.parametrize("name", CELLS)
def test_cell(name, results):
    row = results[name]
    assert not row["failures"], json.dumps(row, indent=1, default=str)[:6000]
