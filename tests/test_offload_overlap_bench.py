"""benchmarks/offload_overlap.py's CPU-checkable parts: the configurations it measures, the
throughput-kept column, the landed updates it reads, the one-step-late reference and the
Markov task of its loss curves, its refusal without CUDA and its plot (the measurements run
on a GPU)."""

from __future__ import annotations

import math

import pytest
import torch

from benchmarks import offload_overlap
from megatron_ext.offload.threads import usable_cores

pytestmark = pytest.mark.mcore


def test_every_offloaded_configuration_comes_as_stock_exact_and_delayed():
    rows = offload_overlap.configs([1.0, 0.5])
    labels = [label for label, _, _ in rows]
    assert labels == [
        "gpu_resident",
        "stock_offload_1.0", "exact_offload_1.0", "overlapped_offload_1.0", "delayed_offload_1.0",
        "stock_offload_0.5", "exact_offload_0.5", "overlapped_offload_0.5", "delayed_offload_0.5",
        f"delayed_offload_1.0_threads_{usable_cores()}", "delayed_offload_1.0_pinned",
    ]  # fmt: skip
    by = {label: (ov, opts) for label, ov, opts in rows}
    assert by["gpu_resident"][0] == {"use_precision_aware_optimizer": True}
    assert by["stock_offload_0.5"][1] is None  # stock: no MegatronOptions, no option
    assert by["exact_offload_0.5"][0]["optimizer_offload_fraction"] == 0.5
    assert by["exact_offload_1.0"][1] == {"offload_step": "chunked"}
    assert by["delayed_offload_1.0"][1]["offload_delayed_update"] is True
    assert not by["exact_offload_1.0"][1].get("offload_delayed_update", False)
    assert by["overlapped_offload_0.5"] == (
        by["exact_offload_0.5"][0],
        {"offload_step": "chunked", "offload_overlap_forward": True},
    )
    # the default worker leaves the launching thread a core; the last row takes them all
    assert "offload_threads" not in by["delayed_offload_1.0"][1]
    assert by[f"delayed_offload_1.0_threads_{usable_cores()}"][1]["offload_threads"] == (
        usable_cores()
    )
    pinned = by["delayed_offload_1.0_pinned"]
    assert pinned == (by["delayed_offload_1.0"][0], by["delayed_offload_1.0"][1] | {
        "offload_pin_threads": True
    })  # fmt: skip
    variants = [label for label, _, _ in offload_overlap.configs([0.5], [3, 5], False)]
    assert variants[-2:] == ["delayed_offload_0.5_threads_3", "delayed_offload_0.5_threads_5"]
    assert offload_overlap.configs([0.5], [], False)[-1][0] == "delayed_offload_0.5"
    assert offload_overlap.parse_args([]).pinned is True
    assert offload_overlap.parse_args(["--no-pinned"]).pinned is False


def test_kept_is_the_gpu_resident_time_at_the_same_micro_batch_count_over_its_own():
    rows = [
        {"config": "gpu_resident", "micro_batches": 1, "step_ms": 30.0},
        {"config": "delayed_offload_1.0", "micro_batches": 1, "step_ms": 40.0},
        {"config": "gpu_resident", "micro_batches": 8, "step_ms": 200.0},
        {"config": "delayed_offload_1.0", "micro_batches": 8, "step_ms": 210.0},
        {"config": "stock_offload_1.0", "micro_batches": 8, "error": "boom"},
    ]
    offload_overlap.add_kept(rows)
    assert rows[0]["kept"] == 1.0
    assert rows[1]["kept"] == pytest.approx(0.75)
    assert rows[3]["kept"] == pytest.approx(200 / 210)
    assert "kept" not in rows[4]


def test_it_refuses_without_cuda_and_writes_nothing(tmp_path):
    with pytest.raises(SystemExit, match="needs CUDA.*nothing written"):
        offload_overlap.main(["--device", "cpu", "--out", str(tmp_path)])
    assert not any(tmp_path.iterdir())


def test_the_plot_shows_kept_and_the_loss_curves(tmp_path):
    pytest.importorskip("matplotlib")
    args = offload_overlap.parse_args(["--out", str(tmp_path), "--device", "cpu"])
    rows = [
        {"config": "gpu_resident", "micro_batches": 1, "step_ms": 30.0},
        {"config": "delayed_offload_1.0", "micro_batches": 1, "step_ms": 40.0},
    ]
    offload_overlap.add_kept(rows)
    curves = {k: [3.0, 2.0 + i / 10, 1.5 + i / 10] for i, k in enumerate(offload_overlap.CURVES)}
    loss = {
        task: {
            "losses": curves,
            "last_relative": 0.05,
            "resident_relative": 0.04,
            "last_steps": 3,
            "floor": floor,
        }
        for task, floor in (("markov", 1.1), ("memorize", None))
    }
    offload_overlap._plot({"rows": rows, "loss": loss}, args, "title")
    assert (tmp_path / "offload_overlap.png").stat().st_size > 0
    # loss curves only (--micro-batches with no count): one panel per task, no kept panel
    drawn = []
    real = offload_overlap.new_figure

    def counting(ncols, **kwargs):
        drawn.append(ncols)
        return real(ncols, **kwargs)

    offload_overlap.new_figure = counting
    try:
        offload_overlap._plot({"rows": [], "loss": loss}, args, "title")
        offload_overlap._plot({"rows": rows, "loss": None}, args, "title")
        offload_overlap._plot({"rows": [], "loss": None}, args, "title")
    finally:
        offload_overlap.new_figure = real
    assert drawn == [2, 2, 2]  # two tasks; kept and the empty loss panel; both empty


def test_without_a_gpu_resident_row_the_plot_shows_the_step_times(tmp_path):
    """No row to keep against (the GPU-resident configuration failed): the panel plots what
    ran, step times, and says why; rows that failed are left out."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    args = offload_overlap.parse_args(["--out", str(tmp_path), "--device", "cpu"])
    rows = [
        {"config": "gpu_resident", "micro_batches": 1, "error": "RuntimeError: no FusedAdam"},
        {"config": "exact_offload_1.0", "micro_batches": 1, "step_ms": 120.0},
        {"config": "exact_offload_1.0", "micro_batches": 8, "step_ms": 300.0},
        {"config": "delayed_offload_1.0", "micro_batches": 1, "step_ms": 94.0},
    ]
    offload_overlap.add_kept(rows)
    fig, ax = plt.subplots()
    offload_overlap._plot_kept(ax, rows, args)
    lines = {line.get_label(): line.get_xydata().tolist() for line in ax.get_lines()}
    assert lines == {
        "exact_offload_1.0": [[1.0, 120.0], [8.0, 300.0]],
        "delayed_offload_1.0": [[1.0, 94.0]],
    }
    assert ax.get_ylabel() == "step ms (median)" and "no GPU-resident row" in ax.get_title()
    plt.close(fig)
    fig, ax = plt.subplots()
    offload_overlap._plot_kept(ax, rows[:1], args)  # nothing ran
    assert not ax.get_lines() and "no configuration ran" in [t.get_text() for t in ax.texts]
    plt.close(fig)


def test_landed_updates_are_read_once_per_offloading_optimizer():
    from megatron_ext.offload.chunked import LandedUpdate

    class Child:
        def __init__(self, landed):
            self.optimizer = type("HDO", (), {})()
            self.optimizer.last_landed = landed

    class Chain:
        chained_optimizers = [
            Child(LandedUpdate(0.5, 0.1, 0.6, 4)),
            Child(None),
            Child(LandedUpdate(1, 0, 2, None)),
        ]

    got = offload_overlap.landed_updates(Chain)
    assert got == [LandedUpdate(0.5, 0.1, 0.6, 4), LandedUpdate(1, 0, 2, None)]
    assert offload_overlap.landed_updates(Chain) == []


def _late_reference(steps: int, warmup: int) -> list[torch.Tensor]:
    """A model whose forward reads a copy of the parameters that is refreshed one step
    late after ``warmup`` exact steps (written without :class:`Lagged`): the loss per step."""
    torch.manual_seed(0)
    master = torch.nn.Linear(6, 3)
    reader = torch.nn.Linear(6, 3)
    reader.load_state_dict(master.state_dict())
    opt = torch.optim.AdamW(master.parameters(), lr=0.05)
    pending, losses = None, []
    for t in range(steps):
        x = torch.randn(8, 6, generator=torch.Generator().manual_seed(t))
        loss = reader(x).pow(2).mean()
        reader.zero_grad()
        loss.backward()
        losses.append(loss.detach())
        if pending is not None:
            reader.load_state_dict(pending)
        for p, q in zip(master.parameters(), reader.parameters(), strict=True):
            p.grad = q.grad.clone()
        opt.step()
        now = {k: v.clone() for k, v in master.state_dict().items()}
        if t >= warmup:
            pending = now
        else:
            pending = None
            reader.load_state_dict(now)
    return losses


@pytest.mark.parametrize("warmup", [0, 2])
def test_lagged_reads_the_parameters_one_step_late(warmup):
    """:class:`Lagged` around a plain optimizer equals a loop that keeps a second copy of
    the model for forward and backward, refreshed one step late: loss by loss, bit for bit;
    and without the lag the losses differ (the test sees the delay)."""
    want = _late_reference(7, warmup)
    for lagged in (True, False):
        torch.manual_seed(0)
        model = torch.nn.Linear(6, 3)
        opt = torch.optim.AdamW(model.parameters(), lr=0.05)
        lag = offload_overlap.Lagged(model.parameters(), warmup) if lagged else None
        got = []
        for t in range(7):
            x = torch.randn(8, 6, generator=torch.Generator().manual_seed(t))
            opt.zero_grad()
            with lag.late_values() if lag else offload_overlap._nothing():
                loss = model(x).pow(2).mean()
                loss.backward()
            got.append(loss.detach())
            if lag:
                lag.before_step()
            opt.step()
            if lag:
                lag.after_step()
        same = all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        assert same is lagged


def test_the_markov_task_follows_its_chain_and_reports_its_entropy():
    tokens, entropy = offload_overlap.markov_tokens(50, 4, 64, 40, seed=3, device="cpu")
    assert tokens.shape == (64, 40) and int(tokens.min()) >= 0 and int(tokens.max()) < 50
    # rebuilt from the same seed as the chain was drawn: every step is one of its successors
    g = torch.Generator().manual_seed(3)
    nxt = torch.randint(0, 50, (50, 4), generator=g)
    weights = -torch.log(torch.rand(50, 4, generator=g))
    probs = weights / weights.sum(dim=1, keepdim=True)
    pairs = zip(
        tokens[:, :-1].reshape(-1).tolist(), tokens[:, 1:].reshape(-1).tolist(), strict=True
    )
    for a, b in pairs:
        assert b in nxt[a].tolist()
    want = sum(-sum(float(p) * math.log(float(p)) for p in row) for row in probs.double()) / 50
    assert entropy == pytest.approx(want, rel=1e-5)
    assert 0 < entropy < math.log(4)


@pytest.mark.parametrize("task", ["markov", "memorize"])
def test_the_labels_are_the_next_tokens_of_the_inputs(task):
    from types import SimpleNamespace

    args = SimpleNamespace(
        seq=12, batch=3, vocab=64, loss_batches=2, loss_steps=5, markov_states=20
    )
    data, floor = offload_overlap.task_batches(args, task, device="cpu")
    assert len(data) == args.loss_steps
    assert (floor is None) is (task == "memorize")
    for tokens, position, mask, labels in data:
        assert tokens.shape == labels.shape == (args.batch, args.seq)
        assert position.shape == (args.batch, args.seq)
        assert mask.shape == (1, 1, args.seq, args.seq)
        # the next-token shift: label j is input j + 1
        assert torch.equal(labels[:, :-1], tokens[:, 1:])
        assert not torch.equal(labels, tokens)
    if task == "markov":
        # rebuilt from the chain's seed: every (input, label) pair is one of its transitions
        g = torch.Generator().manual_seed(2)
        nxt = torch.randint(0, args.markov_states, (args.markov_states, 4), generator=g)
        for tokens, _, _, labels in data:
            pairs = zip(tokens.reshape(-1).tolist(), labels.reshape(-1).tolist(), strict=True)
            for a, b in pairs:
                assert b in nxt[a].tolist()
    else:
        fixed = offload_overlap.batches(args, args.loss_batches, device="cpu")
        for step, (tokens, _, _, labels) in enumerate(data):
            want = fixed[step % args.loss_batches]
            assert torch.equal(tokens, want[0]) and torch.equal(labels, want[3])
        assert not torch.equal(fixed[0][0], fixed[1][0])


def test_every_configuration_has_a_kind_and_kinds_select_them():
    rows = offload_overlap.configs([1.0, 0.5], [3])
    kinds = {label: offload_overlap.kind_of(label) for label, _, _ in rows}
    assert kinds["gpu_resident"] == "gpu_resident"
    assert kinds["stock_offload_0.5"] == "stock"
    assert kinds["overlapped_offload_1.0"] == "overlapped"
    assert kinds["delayed_offload_1.0_threads_3"] == "delayed"
    assert set(kinds.values()) == set(offload_overlap.KINDS)
    with pytest.raises(ValueError, match="no kind"):
        offload_overlap.kind_of("other_offload_1.0")
    assert offload_overlap.parse_args([]).kinds == list(offload_overlap.KINDS)
    args = offload_overlap.parse_args(
        ["--kinds", "exact", "overlapped", "--fractions", "1.0", "0.5", "--thread-variants"]
    )
    assert [label for label, _, _ in offload_overlap.selected_configs(args)] == [
        "exact_offload_1.0", "overlapped_offload_1.0",
        "exact_offload_0.5", "overlapped_offload_0.5",
    ]  # fmt: skip
    args = offload_overlap.parse_args(["--fractions", "1.0"])
    assert offload_overlap.selected_configs(args) == offload_overlap.configs([1.0])
    args = offload_overlap.parse_args(
        ["--kinds", "overlapped", "--fractions", "1.0", "0.5", "--overlap-threads", "7"]
    )
    got = {label: opts for label, _, opts in offload_overlap.selected_configs(args)}
    assert list(got) == [
        "overlapped_offload_1.0", "overlapped_offload_0.5", "overlapped_offload_1.0_threads_7",
    ]  # fmt: skip
    assert got["overlapped_offload_1.0_threads_7"] == got["overlapped_offload_1.0"] | {
        "offload_threads": 7
    }
    assert "offload_threads" not in got["overlapped_offload_1.0"]
