"""One process-wide NCCL world of one rank and Megatron's parallel state, for GPU tests."""

import os

import pytest
import torch


@pytest.fixture(scope="session")
def megatron_world():
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    ps.initialize_model_parallel()
    yield
    ps.destroy_model_parallel()
    dist.destroy_process_group()
