import sys

import pytest
import torch

# Test support holding helpers that several test modules share: their assertions report
# the values they compared, as a test module's own do (pytest rewrites only those).
pytest.register_assert_rewrite(
    "tests.support.delayed_model",
    "tests.support.distopt_ranks",
    "tests.support.gpt_on_the_cpu",
    "tests.support.gpu_mixed_stack",
    "tests.support.gpu_offload_stack",
    "tests.support.megatron_mlp",
    "tests.support.megatron_ranks",
    "tests.support.mlp_stack",
    "tests.support.refusing_calls",
    "tests.support.reshard_plans",
)

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.cuda,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
        ],
    ),
]


@pytest.fixture(params=DEVICES)
def device(request) -> torch.device:
    return torch.device(request.param)


@pytest.fixture
def fresh_native(monkeypatch, tmp_path):
    """No compiled kernel loaded yet in this process (the CPU norm's, ``buffers.native``,
    and the offloaded step's, ``megatron_ext.offload.host_kernel``), an empty cache folder of
    its own, ``BUFFERS_CPU_KERNEL`` unset. Returns the cache folder. The offload kernel's
    module is reset only where it was imported (it imports megatron-core, which the
    torch-only install lacks; imported later, it starts empty)."""
    from buffers import native

    monkeypatch.setattr(native, "_LOADED", {})
    offload_native = sys.modules.get("megatron_ext.offload.host_kernel")
    if offload_native is not None:
        monkeypatch.setattr(offload_native, "_LOADED", {})
    monkeypatch.setenv("BUFFERS_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("BUFFERS_CPU_KERNEL", raising=False)
    return tmp_path / "cache"


@pytest.fixture
def cpu_streams(monkeypatch):
    """torch.cuda's streams and events replaced by recording stand-ins and every host-mirror
    copy of the offload code checked against them
    (:func:`tests.support.offload_sim.recording_streams`); the log."""
    from tests.support.offload_sim import recording_streams

    return recording_streams(monkeypatch)
