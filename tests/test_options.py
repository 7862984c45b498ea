"""Behaviour switches as explicit options, environment variables only as overrides."""

import pytest
import torch

from buffers import BufferOptions, FlatGradBuffers, graphs, ops
from megatron_ext import MegatronOptions

pytestmark = pytest.mark.mcore


def test_defaults_and_validation():
    o = BufferOptions()
    assert (o.backend, o.cuda_graphs, o.graph_collectives) == ("auto", True, True)
    with pytest.raises(ValueError, match="backend='cuda'"):
        BufferOptions(backend="cuda")
    assert MegatronOptions().host_mirrors is True
    assert MegatronOptions(host_mirrors=False, backend="torch").backend == "torch"


SWITCHES = {
    BufferOptions: ["cuda_graphs", "graph_collectives"],
    MegatronOptions: [
        "cuda_graphs",
        "host_mirrors",
        "offload_delayed_update",
        "offload_pin_threads",
        "offload_overlap_forward",
    ],
}


@pytest.mark.parametrize("bad", ["no", 0, 1, None])
@pytest.mark.parametrize("kind", SWITCHES)
def test_a_switch_that_is_not_a_bool_is_refused(kind, bad):
    # "no" is truthy: it would have turned the switch on
    for name in SWITCHES[kind]:
        with pytest.raises(TypeError, match=rf"^{kind.__name__}\({name}={bad!r}\): expected True"):
            kind(**{name: bad})
    assert kind(**dict.fromkeys(SWITCHES[kind], False)) is not None


def test_offload_chunk_numel_is_an_int_not_a_bool():
    with pytest.raises(ValueError, match="offload_chunk_numel=True"):
        MegatronOptions(offload_chunk_numel=True)
    assert MegatronOptions(offload_chunk_numel=1).offload_chunk_numel == 1


def test_environment_variables_override_the_options(monkeypatch):
    off = BufferOptions(cuda_graphs=False, graph_collectives=False, backend="torch")
    on = BufferOptions()
    assert not off.effective_cuda_graphs and on.effective_cuda_graphs
    monkeypatch.setenv("BUFFERS_CUDA_GRAPHS", "1")
    monkeypatch.setenv("BUFFERS_GRAPH_COLLECTIVES", "0")
    monkeypatch.setenv("BUFFERS_BACKEND", "triton")
    assert off.effective_cuda_graphs and not on.effective_graph_collectives
    assert off.effective_backend == "triton"
    monkeypatch.setenv("BUFFERS_CUDA_GRAPHS", "yes")
    with pytest.raises(ValueError, match="BUFFERS_CUDA_GRAPHS='yes'"):
        _ = on.effective_cuda_graphs
    monkeypatch.setenv("BUFFERS_BACKEND", "cuda")
    with pytest.raises(ValueError, match="BUFFERS_BACKEND='cuda'"):
        _ = on.effective_backend


def test_graph_switches_follow_the_options(monkeypatch):
    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert graphs.graphs_enabled(cuda, BufferOptions())
    assert not graphs.graphs_enabled(cuda, BufferOptions(cuda_graphs=False))
    assert not graphs._capture_allowed(cuda, BufferOptions(graph_collectives=False))
    assert graphs._capture_allowed(cuda, BufferOptions())


def test_the_backend_follows_the_options_per_choice(monkeypatch):
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(ops, "_CUDA_CACHE", {})
    monkeypatch.setattr(ops, "_load_triton", lambda: "triton backend")
    assert ops.backend_for(cuda, BufferOptions(backend="torch")).name == "torch"
    assert ops.backend_for(cuda, BufferOptions()) == "triton backend"
    assert ops.backend_for(torch.device("cpu"), BufferOptions(backend="triton")).name == "torch"


def test_flat_grad_buffers_take_options():
    p = torch.nn.Parameter(torch.randn(10))
    fgb = FlatGradBuffers([p], options=BufferOptions(cuda_graphs=False))
    assert fgb._norm_clip.options.cuda_graphs is False
    assert fgb._norm_clip.replay.options is fgb.options


def test_offload_step_choices_are_checked():
    # chunked by default over host mirrors; without them the per-parameter step is the one
    assert MegatronOptions().offload_step == "chunked"
    assert MegatronOptions(host_mirrors=False).offload_step == "per_parameter"
    assert MegatronOptions(offload_step="per_parameter").offload_step == "per_parameter"
    assert MegatronOptions(offload_step="chunked").offload_chunk_numel == 4 * 2**20
    with pytest.raises(ValueError, match=r"offload_step='fast'; expected one of"):
        MegatronOptions(offload_step="fast")
    with pytest.raises(ValueError, match="runs over host mirrors; leave host_mirrors=True"):
        MegatronOptions(offload_step="chunked", host_mirrors=False)
    for bad in (0, -5, 2.5):
        with pytest.raises(ValueError, match="offload_chunk_numel=.*positive int"):
            MegatronOptions(offload_chunk_numel=bad)


def test_offload_convert_choices_are_checked():
    assert MegatronOptions().offload_convert == "host"
    device = MegatronOptions(offload_convert="device", offload_step="chunked")
    assert device.offload_convert == "device"
    with pytest.raises(ValueError, match=r"offload_convert='gpu'; expected one of"):
        MegatronOptions(offload_convert="gpu")
    assert MegatronOptions(offload_convert="device").offload_step == "chunked"
    with pytest.raises(ValueError, match="needs offload_step='chunked'"):
        MegatronOptions(offload_convert="device", offload_step="per_parameter")
    with pytest.raises(ValueError, match="runs over host mirrors"):
        MegatronOptions(offload_convert="device", offload_step="chunked", host_mirrors=False)


def test_delayed_update_options_are_checked():
    assert MegatronOptions().offload_delayed_update is False
    on = MegatronOptions(offload_delayed_update=True, offload_delay_warmup=0)
    assert (on.offload_step, on.offload_delay_warmup) == ("chunked", 0)
    with pytest.raises(ValueError, match="offload_delayed_update=True runs the chunked step"):
        MegatronOptions(offload_delayed_update=True, offload_step="per_parameter")
    with pytest.raises(ValueError, match="offload_delayed_update=True runs the chunked step"):
        MegatronOptions(offload_delayed_update=True, host_mirrors=False)
    for bad in (-1, 2.5, True, "3"):
        with pytest.raises(ValueError, match="offload_delay_warmup=.*int >= 0"):
            MegatronOptions(offload_delay_warmup=bad)


def test_pinning_the_threads_needs_the_delayed_update():
    assert MegatronOptions().offload_pin_threads is False
    on = MegatronOptions(offload_delayed_update=True, offload_pin_threads=True)
    assert on.offload_pin_threads
    with pytest.raises(ValueError, match="offload_pin_threads=True pins the delayed update"):
        MegatronOptions(offload_pin_threads=True)


def test_the_overlapped_step_needs_the_chunked_step_and_not_the_delayed_update():
    assert MegatronOptions().offload_overlap_forward is False
    assert MegatronOptions(offload_overlap_forward=True).offload_overlap_forward
    with pytest.raises(ValueError, match="offload_overlap_forward=True runs the chunked step"):
        MegatronOptions(offload_overlap_forward=True, offload_step="per_parameter")
    with pytest.raises(ValueError, match="offload_overlap_forward=True runs the chunked step"):
        MegatronOptions(offload_overlap_forward=True, host_mirrors=False)
    with pytest.raises(ValueError, match="exact, or one step late.*choose one"):
        MegatronOptions(offload_overlap_forward=True, offload_delayed_update=True)


def test_offload_threads_are_checked():
    assert MegatronOptions().offload_threads is None
    assert MegatronOptions(offload_threads=3).offload_threads == 3
    for bad in (0, -1, 2.0, True, "4"):
        with pytest.raises(ValueError, match="offload_threads=.*positive int"):
            MegatronOptions(offload_threads=bad)


@pytest.mark.parametrize(
    "variable, value",
    [
        ("BUFFERS_BACKEND", "torhc"),
        ("BUFFERS_CUDA_GRAPHS", "yes"),
        ("BUFFERS_GRAPH_COLLECTIVES", "on"),
    ],
)
def test_a_misspelt_environment_switch_is_refused_on_the_cpu_too(monkeypatch, variable, value):
    # The CPU never uses these switches, so nothing read them: a typo went unnoticed until
    # the job moved to a GPU. Building the buffers reads every one of them.
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValueError, match=rf"{variable}={value!r}.*(auto|0 or 1)"):
        FlatGradBuffers([torch.nn.Parameter(torch.zeros(3))])
    with pytest.raises(ValueError, match=variable):
        BufferOptions().check_environment()
    if variable == "BUFFERS_BACKEND":
        with pytest.raises(ValueError, match="BUFFERS_BACKEND='torhc'"):
            ops.backend_for(torch.device("cpu"))


def test_offload_options_without_cpu_offload_are_refused_naming_them():
    """get_megatron_optimizer refuses options only CPU offload reads when the config does
    not offload, before megatron-core builds anything; the defaults pass."""
    from types import SimpleNamespace

    from megatron_ext import get_megatron_optimizer

    chunk = torch.nn.Linear(2, 2)
    chunk.per_dtype_grad_buffers = True
    config = SimpleNamespace(optimizer_cpu_offload=False)
    for options, named in (
        (MegatronOptions(offload_delayed_update=True), "offload_delayed_update=True"),
        (MegatronOptions(offload_overlap_forward=True), "offload_overlap_forward=True"),
        (MegatronOptions(offload_threads=4, offload_convert="device"), "offload_threads=4, "),
    ):
        with pytest.raises(ValueError, match=f"MegatronOptions\\({named}.*optimizer_cpu_offload=F"):
            get_megatron_optimizer(config, [chunk], options=options)
    assert MegatronOptions().offload_only() == []
    assert MegatronOptions(offload_step="per_parameter").offload_only() == []


@pytest.mark.parametrize("kind", [BufferOptions, MegatronOptions])
def test_every_option_is_documented_once_in_its_class(kind):
    import dataclasses
    import re

    own = {f.name for f in dataclasses.fields(kind)} - (
        {f.name for f in dataclasses.fields(BufferOptions)} if kind is MegatronOptions else set()
    )
    attributes = kind.__doc__.split("Attributes:", 1)[1].strip("\n")
    indent = attributes[: len(attributes) - len(attributes.lstrip())]  # the entries' own
    entries = re.findall(rf"^{indent}(\w+): ", attributes, flags=re.M)
    assert sorted(entries) == sorted(own), (entries, own)  # each once, none missing
