"""Stand-ins for process groups in CPU tests."""


class FakeGroup:
    """A process group that only answers ``rank()`` and ``size()``."""

    def __init__(self, rank: int, size: int):
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


def megatron_buffer(grad, index, buckets, group):
    """A stand-in for megatron-core's ``_ParamAndGradBuffer``: the attributes the library
    reads, over ``grad`` (the flat gradients), ``index`` (its ``param_index_map``) and
    ``buckets`` (``(start, end)`` per bucket)."""
    import types

    import torch

    return types.SimpleNamespace(
        param_dtype=grad.dtype,
        grad_dtype=grad.dtype,
        grad_data=grad,
        param_data=torch.zeros(grad.numel(), dtype=grad.dtype),
        numel=grad.numel(),
        param_index_map=index,
        bucket_indices=buckets,
        buckets=[types.SimpleNamespace(grad_data=grad[s:e], offset=s) for s, e in buckets],
        data_parallel_group=group,
        num_optimizer_shards=None,
    )
