"""Offloaded optimizer state across a save and a load, on the CPU: the trajectory kept,
the CPU copies refreshed, state on its parameters' device, checkpoints moved between the
step kinds, and the weights-only unpickler."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support import offload_internals
from tests.support.offload_sim import (
    MirrorChunked,
    MirrorPlaced,
    StockPlaced,
    assert_same_run,
    assert_same_state,
    make_hdo,
    sim,
    train,
    train_switching,
)
from tests.support.spawn import process

pytestmark = pytest.mark.mcore


@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_state_dict_round_trip_keeps_the_trajectory(cpu_streams, fraction):
    """load_state_dict rebuilds the CPU copies and mirrors; training continues bit for bit,
    natively fp32 parameters included (megatron-core's own reload raises KeyError there)."""
    finals = []
    for reload in (False, True):
        bf16, fp32, groups, sources, bind, shard16 = sim(True, True, False, 1, 0)
        hdo = make_hdo(MirrorPlaced, groups, fraction, False, sources)
        gen = torch.Generator().manual_seed(5)
        for step in range(4):
            if reload and step == 2:
                before = [c.data_ptr() for c in hdo.cpu_copys_map_gpu_param]
                hdo.load_state_dict(hdo.state_dict())
                assert [c.data_ptr() for c in hdo.cpu_copys_map_gpu_param] != before
                hosts = {m.host_params.untyped_storage().data_ptr() for m in hdo.host_mirrors}
                for c in hdo.cpu_copys_map_gpu_param:
                    assert c.untyped_storage().data_ptr() in hosts
            bf16.grad_data.copy_(torch.randn(bf16.grad_data.numel(), generator=gen))
            fp32.grad_data.copy_(torch.randn(fp32.grad_data.numel(), generator=gen))
            bind()
            hdo.step()
        finals.append((bf16, fp32, hdo))
    (a16, a32, a), (b16, b32, b) = finals
    assert torch.equal(a16.param_data, b16.param_data)
    assert torch.equal(a32.param_data, b32.param_data)
    assert_same_state(a, b)


def test_model_param_reload_refreshes_every_cpu_copy(cpu_streams):
    _, fp32, groups, sources, _, _ = sim(True, True, False, 1, 0)
    hdo = make_hdo(MirrorPlaced, groups, 1.0, False, sources)
    fp32.param_data.fill_(3.0)
    hdo.update_fp32_param_by_new_param()  # megatron-core skips natively fp32 parameters
    for orig, cpu in hdo.gpu_params_map_cpu_copy.items():
        if orig.dtype == torch.float32:
            assert torch.all(cpu == 3.0)


def test_sub_optimizer_state_goes_to_its_parameters_device():
    """After a load, megatron-core's sync can leave a GPU sub-optimizer's moments on the CPU
    (it tells the sub-optimizers apart by class). Each state tensor goes to its parameter's
    device; ``step`` stays where torch keeps it (on the device only for fused/capturable
    groups). The ``meta`` device stands in for the GPU."""
    import types

    from megatron_ext.opt_checkpoint import place_sub_optimizer_state

    gpu_p = torch.nn.Parameter(torch.zeros(3, device="meta"))
    cpu_p = torch.nn.Parameter(torch.zeros(3))
    gpu_opt = types.SimpleNamespace(param_groups=[{"params": [gpu_p], "fused": True}], state={})
    cpu_opt = types.SimpleNamespace(param_groups=[{"params": [cpu_p], "fused": None}], state={})
    gpu_opt.state[gpu_p] = {"exp_avg": torch.ones(3), "step": torch.tensor(4.0), "lr": 0.1}
    cpu_state = {"exp_avg": torch.ones(3), "step": torch.tensor(4.0)}
    cpu_opt.state[cpu_p] = dict(cpu_state)
    shared = gpu_opt.state[gpu_p]  # the offload optimizer's own state holds the same dicts
    place_sub_optimizer_state(types.SimpleNamespace(sub_optimizers=[gpu_opt, cpu_opt]))
    assert shared["exp_avg"].device.type == "meta" and shared["step"].device.type == "meta"
    assert shared["lr"] == 0.1
    # already where they belong: the very same tensors (a CPU step stays on the CPU)
    assert all(cpu_opt.state[cpu_p][k] is v for k, v in cpu_state.items())


@pytest.mark.parametrize("fraction", [0.5, 1.0])
@pytest.mark.parametrize("pa", [True, False], ids=["pa", "main"])
@pytest.mark.parametrize(
    "first,second",
    [(MirrorChunked, MirrorPlaced), (MirrorPlaced, MirrorChunked)],
    ids=["chunked_to_per_parameter", "per_parameter_to_chunked"],
)
def test_checkpoints_move_between_the_chunked_and_per_parameter_steps(
    cpu_streams, first, second, pa, fraction
):
    """Saved by one step kind, loaded into the other: megatron-core's format either way,
    and the run continues as an uninterrupted per-parameter one, bit for bit."""
    plain = train(StockPlaced, pa, fraction, 4)
    switched = train_switching(first, second, pa, fraction, 4, switch_at=2)
    assert (offload_internals.chunked(switched[2]) is not None) == (second is MirrorChunked)
    assert_same_run(plain, switched)


@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_chunked_step_state_round_trip_keeps_the_trajectory(cpu_streams, fraction):
    """A loaded state (other tensors than the flat moments' views) is copied in, re-bound,
    and training continues as without the reload; the state still holds views after."""
    plain = train(MirrorChunked, True, fraction, 4)
    reloaded = train(MirrorChunked, True, fraction, 4, reload_at=2)
    assert_same_run(plain, reloaded)
    for stepper in offload_internals.chunked(reloaded[2]).steppers:
        for e in stepper.entries:
            st = e.optimizer.state[e.param]
            assert st["exp_avg"].untyped_storage().data_ptr() == (
                stepper.exp_avg.untyped_storage().data_ptr()
            )
            assert st["step"].item() == 4


def _weights_only_load_before_and_after_allowing(path: str, out: str) -> None:
    """In a process of its own: save a common state holding the optimizer classes, load it
    with the weights-only unpickler, allow the classes, load it again; a line per step."""
    import types

    from megatron_ext.offload.checkpoint_classes import allow_optimizer_classes_in_checkpoints

    lines = []
    groups = [{"lr": 0.1, "cpu_optimizer_cls": torch.optim.AdamW,
               "gpu_optimizer_cls": torch.optim.Adam}]  # fmt: skip
    torch.save({"param_groups": groups}, path)
    try:
        torch.load(path)
        lines.append("loaded before")
    except Exception as e:  # noqa: BLE001 - which one is the result
        lines.append(f"refused before: {type(e).__name__}")
    hdo = types.SimpleNamespace(cpu_optimizer_cls=torch.optim.AdamW,
                                gpu_optimizer_cls=torch.optim.Adam)  # fmt: skip
    allowed = allow_optimizer_classes_in_checkpoints(hdo)
    lines.append(f"allowed {[c.__name__ for c in allowed]}")
    got = torch.load(path)["param_groups"][0]
    lines.append(f"loaded after {got['cpu_optimizer_cls'] is torch.optim.AdamW} {got['lr']}")
    Path(out).write_text("\n".join(lines))


def test_offload_checkpoints_load_with_the_weights_only_unpickler(tmp_path):
    """megatron-core's offload optimizer keeps its optimizer classes in every param group;
    megatron-core 0.18 loads the common checkpoint state with torch's weights-only
    unpickler, which refuses them until they are allowed. In a process of its own (torch's
    safe globals are per process; a rank of tests/support/spawn.py, which no test has run
    in): refused before, loaded after."""
    out = tmp_path / "lines.txt"
    child = process(
        _weights_only_load_before_and_after_allowing, args=(str(tmp_path / "common.pt"), str(out))
    )
    child.start()
    child.join(timeout=120)
    if child.is_alive():
        child.kill()
    assert child.exitcode == 0, f"exit code {child.exitcode}"
    assert out.read_text().splitlines() == [
        "refused before: UnpicklingError",
        "allowed ['AdamW', 'Adam']",
        "loaded after True 0.1",
    ]
