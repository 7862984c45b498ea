"""The transformer-engine GPT cells of tests/gpu/test_te_layers_gpu.py, rehearsed on the CPU.

The worker (``tests/gpu/te_layers_worker.py``, launched and judged by
``tests/gpu/te_layers_driver.py``) runs here with megatron-core's local layer
spec through ``tests/support/cpu_megatron.py`` (no TE, so no TE layers, no precision-aware
optimizer, no offload): the GPT, islands, micro-batches, the fp64 reference, both arms in
their own processes, a stock crash as a row with the run going on, and the judging of
every kind of row; what the GPU run adds is TE itself.
"""

import json
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))
import te_layers_driver as w  # noqa: E402

# Without transformer-engine megatron-core's norm takes its fallback kernels, about 2e-6
# from fp64 here (with TE on the GPU: within 1e-7, the GPU test's bound is 1e-6).
STOCK_TOL_WITHOUT_TE = 1e-5

pytestmark = pytest.mark.mcore  # the driver builds megatron-core's GPT in its workers
CPU_CELLS = ["distopt_islands_on_mb2_w1", "fp16_islands_on_mb1_w1", "distopt_islands_off_mb1_w1"]


def test_cells_are_named_parsed_and_have_a_stock_counterpart():
    cells = w.cells()
    assert len(cells) == len(set(cells)) <= 40  # moderate: the GPU window is short
    for name in cells:
        cell = w.parse_cell(name)
        assert w.cell_name(**cell) == name
        stock = w.parse_cell(w.stock_cell(name))
        assert "chunked" not in stock["kind"] and stock["world"] == cell["world"]
    kinds = {w.parse_cell(n)["kind"] for n in cells}
    assert kinds == set(w.KINDS)
    assert {(w.parse_cell(n)["micro"], w.parse_cell(n)["world"]) for n in cells} == {
        (1, 1),
        (2, 1),
        (2, 2),
    }
    with pytest.raises(ValueError, match="not a cell name"):
        w.parse_cell("adam_islands_on_mb1_w1")


def test_stock_expectations_are_the_known_failures():
    assert w.stock_expected("pa", True) == w.STOCK_MIXED_NORM
    assert w.stock_expected("pa_offload1.0", True) == w.STOCK_NON_LEAF
    assert w.stock_expected("pa_offload0.5", True) == w.STOCK_NON_LEAF
    assert all(w.stock_expected(k, False) == "ok" for k in w.KINDS)
    assert w.stock_expected("distopt", True) == w.stock_expected("fp16", True) == "ok"


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    """Both arms of three cells on the CPU; stock's second cell aborts its process."""
    out = tmp_path_factory.mktemp("te_layers")
    mp = pytest.MonkeyPatch()
    mp.setenv("TE_LAYERS_FAULT", f"abort:{CPU_CELLS[1]}")
    mp.setenv("PYTHONWARNINGS", "ignore")
    try:
        ours = w.launch("ours", CPU_CELLS, out, cpu=True, timeout=300)
        stock = w.launch("stock", CPU_CELLS, out, cpu=True, timeout=300)
    finally:
        mp.undo()
    return out, ours, stock


def test_ours_on_the_cpu_is_right_every_step(cpu_run):
    out, ours, _ = cpu_run
    for name in CPU_CELLS:
        row = ours[name]
        assert row["status"] == "ok", row
        assert len(row["steps"]) == w.STEPS
        errors = w.norm_errors(row)
        assert max(errors) <= 1e-6, errors
        assert all(s["ref"] > w.CLIP and math.isfinite(s["loss"]) for s in row["steps"])
        assert (out / f"ours-{name}.pt").is_file() and (out / f"ours-{name}-1.pt").is_file()
    assert ours[CPU_CELLS[0]]["grad_dtypes"] == ["torch.bfloat16", "torch.float32"]
    assert ours[CPU_CELLS[1]]["grad_dtypes"] == ["torch.float16", "torch.float32"]
    assert ours[CPU_CELLS[1]]["steps"][0]["scale"] == 2.0**12
    assert ours[CPU_CELLS[2]]["grad_dtypes"] == ["torch.bfloat16"]


def test_a_stock_crash_is_a_row_and_the_run_goes_on(cpu_run):
    out, ours, stock = cpu_run
    crashed = stock[CPU_CELLS[1]]
    assert crashed["status"].startswith("crashed") and "SIGABRT" in crashed["error"], crashed
    row = w.judge(CPU_CELLS[1], ours[CPU_CELLS[1]], crashed, out, STOCK_TOL_WITHOUT_TE)
    assert row["stock"].startswith("crashed")
    assert row["failures"] and "stock: crashed" in row["failures"][0]
    for name in (CPU_CELLS[0], CPU_CELLS[2]):  # before and after the crash
        row = w.judge(name, ours[name], stock[name], out, STOCK_TOL_WITHOUT_TE)
        assert row["stock"] == "ok" and not row["failures"], row
        assert row["params_worst"] <= 1.0 and row["loss_vs_stock"] <= w.LOSS_RTOL
    text = w.table([w.judge(n, ours[n], stock[n], out, STOCK_TOL_WITHOUT_TE) for n in CPU_CELLS])
    print(text)
    assert len(text.splitlines()) >= 2 + len(CPU_CELLS) and "FAILED" in text


def _row(name, status="ok", norms=(1.0, 1.0, 1.0), refs=(1.0, 1.0, 1.0), **extra):
    cell = w.parse_cell(name)
    steps = [
        dict(ok=True, norm=n, ref=r, loss=5.0, scale=1.0) for n, r in zip(norms, refs, strict=True)
    ]
    low = "torch.float16" if cell["kind"] == "fp16" else "torch.bfloat16"
    dtypes = sorted({low, "torch.float32"} if cell["islands"] else {low})
    row = dict(cell=name, **cell, te=True, status=status, error=None, steps=steps, te_weights=4,
               te_fused=4, grad_dtypes=dtypes)  # fmt: skip
    return row | extra


def test_judging_stock_failures_as_rows(tmp_path):
    name = "pa_islands_on_mb2_w1"
    inf = _row(name, norms=(math.inf,) * 3)
    row = w.judge(name, _row(name), inf, tmp_path)
    assert row["stock"] == "nonfinite" and not row["failures"]
    # the same defect can give a finite norm that is wrong (seen with one micro-batch)
    off = _row(name, norms=(1.0 + 1.2e-5,) * 3)
    row = w.judge(name, _row(name), off, tmp_path)
    assert row["stock"] == "wrong norm" and not row["failures"], row
    assert "wrong norm" in w.table([row])
    # the known failure not happening is a failure of the expectation, not a pass
    assert w.judge(name, _row(name), _row(name), tmp_path)["failures"]
    name = "pa_offload1.0_chunked_islands_on_mb1_w1"
    refused = _row(
        w.stock_cell(name), status="build failed", error=f"ValueError: {w.STOCK_NON_LEAF}"
    )
    refused["steps"] = []
    row = w.judge(name, _row(name), refused, tmp_path)
    assert row["stock"] == "build failed" and not row["failures"]
    assert w.STOCK_NON_LEAF in w.table([row])


def test_stock_that_builds_and_leaves_fp32_parameters_unstepped_is_that_row(tmp_path):
    """At offload fraction < 1 a rank whose fp32 shards all sit in the GPU-resident part
    builds, where the others refuse, and never steps them: an expected row of its own. The
    same in a cell where stock is expected to run right is a failure, and so is ours
    leaving an fp32 parameter unchanged."""
    name = "pa_offload0.5_chunked_islands_on_mb2_w2"
    frozen = _row(w.stock_cell(name), fp32_unchanged=["decoder.layers.0.island"])
    row = w.judge(name, _row(name, fp32_unchanged=[]), frozen, tmp_path)
    assert row["stock"] == w.STOCK_FP32_UNSTEPPED and not row["failures"], row
    assert "decoder.layers.0.island" in row["stock_error"]
    assert "never stepped" in w.table([row])
    # without the record, a stock run in this cell is still a failure of the expectation
    assert w.judge(name, _row(name), _row(w.stock_cell(name)), tmp_path)["failures"]
    name = "distopt_islands_on_mb1_w1"
    row = w.judge(name, _row(name), _row(name, fp32_unchanged=["x"]), tmp_path)
    assert row["failures"] and "stock" in row["failures"][0]
    name = "pa_islands_on_mb1_w1"  # stock's norm non-finite, as expected: only ours judged
    ours = _row(name, fp32_unchanged=["decoder.layers.1.island"])
    failures = w.judge(name, ours, _row(name, norms=(math.inf,) * 3), tmp_path)["failures"]
    assert any("ours: fp32 parameters never changed" in f for f in failures), failures


def test_judging_ours(tmp_path):
    name = "pa_islands_on_mb1_w1"
    stock = _row(name, norms=(math.nan,) * 3)
    off = _row(name, norms=(1.0, 1.0 + 2e-6, 1.0))
    assert "norm vs fp64" in w.judge(name, off, stock, tmp_path)["failures"][0]
    unfused = _row(name, te_fused=3)
    assert "fuse_wgrad_accumulation" in " ".join(
        w.judge(name, unfused, stock, tmp_path)["failures"]
    )
    no_te = _row(name, te_weights=0, te_fused=0)
    assert "no transformer-engine layer" in w.judge(name, no_te, stock, tmp_path)["failures"][0]
    no_island = _row(name, grad_dtypes=["torch.bfloat16"])
    assert "gradient buffers" in " ".join(w.judge(name, no_island, stock, tmp_path)["failures"])
    unclipped = _row(name, refs=(0.01, 0.01, 0.01), norms=(0.01, 0.01, 0.01))
    assert "clipping" in w.judge(name, unclipped, stock, tmp_path)["failures"][0]


def test_parameters_compared_within_one_unit_in_the_last_place(tmp_path):
    x = torch.tensor([1.0, -0.5, 3.0]).bfloat16()
    dtypes = {"a": "torch.bfloat16"}
    torch.save(dict(params={"a": x.float()}, dtypes=dtypes), tmp_path / "stock.pt")
    one_ulp = (x.view(torch.int16) + 1).view(torch.bfloat16)  # one unit in the last place
    torch.save(dict(params={"a": one_ulp.float()}, dtypes=dtypes), tmp_path / "ours.pt")
    cmp = w.compare_params(tmp_path / "ours.pt", tmp_path / "stock.pt")
    assert cmp["bad"] == [] and cmp["equal"] == 0 and cmp["worst"] <= 1.0
    two = (x.view(torch.int16) + 2).view(torch.bfloat16)
    torch.save(dict(params={"a": two.float()}, dtypes=dtypes), tmp_path / "ours.pt")
    assert w.compare_params(tmp_path / "ours.pt", tmp_path / "stock.pt")["bad"] == ["a"]


def test_two_ranks_on_the_cpu(tmp_path, monkeypatch):
    """Two gloo ranks: the reference sums each rank's shard of the reduced buffers."""
    monkeypatch.setenv("PYTHONWARNINGS", "ignore")
    name = "fp16_islands_on_mb2_w2"
    ours = w.launch("ours", [name], tmp_path, cpu=True, timeout=300)[name]
    stock = w.launch("stock", [name], tmp_path, cpu=True, timeout=300)[name]
    assert not ours["ranks_disagree"] and not stock["ranks_disagree"]
    row = w.judge(name, ours, stock, tmp_path, STOCK_TOL_WITHOUT_TE)
    assert row["stock"] == "ok" and not row["failures"], row


def test_a_stock_cell_that_hangs_is_killed_with_its_workers(tmp_path, monkeypatch):
    """Past the launch's time the whole process group goes (torchrun and its worker), the
    cell is a crashed row, and the cells after it run in a fresh launch."""
    monkeypatch.setenv("PYTHONWARNINGS", "ignore")
    names = ["distopt_islands_off_mb1_w1", "distopt_islands_on_mb1_w1"]
    monkeypatch.setenv("TE_LAYERS_FAULT", f"hang:{names[0]}")
    rows = w.launch("stock", names, tmp_path, cpu=True, timeout=30)
    assert rows[names[0]]["status"] == "crashed (timeout)"
    assert rows[names[1]]["status"] == "ok"
    import subprocess

    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert f"--out {tmp_path}" not in ps  # no worker left behind


def test_every_cell_judged_with_stocks_known_failures_as_rows(tmp_path, monkeypatch):
    """run_all (what the GPU test's fixture runs) over stand-in rows that behave as stock is
    known to: every cell judged without failures, stock launched once per stock cell, the
    table and JSON written; and a stock that does not fail where it is known to is a
    failure."""
    launched = []

    def rows_like_the_gpu(arm, names, out, timeout, surprise=False):
        launched.append((arm, tuple(names)))
        rows = {}
        for n in names:
            cell = w.parse_cell(n)
            expected = w.stock_expected(cell["kind"], cell["islands"])
            if arm == "stock" and not surprise and expected == w.STOCK_NON_LEAF:
                rows[n] = dict(cell=n, status="build failed", error=f"ValueError: {expected}")
                continue
            mixed = arm == "stock" and expected == w.STOCK_MIXED_NORM and not surprise
            norm = (math.inf if n.endswith("mb2_w1") else 1.5) if mixed else 1.0
            rows[n] = _row(n, norms=(norm,) * 3, refs=(1.0,) * 3) | dict(arm=arm)
        return rows

    monkeypatch.setattr(w, "launch", rows_like_the_gpu)
    monkeypatch.setattr(w, "compare_params", lambda a, b: dict(worst=0.5, equal=1, total=2, bad=[]))
    judged, text = w.run_all(w.cells(), tmp_path / "out", 1.0)
    assert set(judged) == set(w.cells())
    assert not [r["failures"] for r in judged.values() if r["failures"]]
    stock_runs = [names for arm, names in launched if arm == "stock"]
    assert all("chunked" not in n for names in stock_runs for n in names)
    assert sum(map(len, stock_runs)) == len({w.stock_cell(n) for n in w.cells()})
    rows = json.loads((tmp_path / "out" / "te_layers.json").read_text())
    assert [r["cell"] for r in rows] == w.cells()
    assert "stock error: ValueError: can't optimize a non-leaf Tensor" in text
    # pa with islands, 3 cells: one non-finite, two wrong
    assert sorted(r["stock"] for r in rows if r["expected_stock"] == w.STOCK_MIXED_NORM) == [
        "nonfinite", "wrong norm", "wrong norm",
    ]  # fmt: skip

    monkeypatch.setattr(w, "launch", lambda *a, **k: rows_like_the_gpu(*a, **k, surprise=True))
    judged, _ = w.run_all(["pa_islands_on_mb1_w1", "pa_offload1.0_islands_on_mb1_w1"], tmp_path, 1)
    assert all(r["failures"] for r in judged.values())
