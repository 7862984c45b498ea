"""Behaviour switches of the flat norm and clip, as one explicit, frozen option set.

Pass :class:`BufferOptions` where the buffers are built (``FlatGradBuffers(...,
options=...)``; the Megatron side's :class:`megatron_ext.options.MegatronOptions` extends
it). The environment variables ``BUFFERS_BACKEND``, ``BUFFERS_CUDA_GRAPHS`` and
``BUFFERS_GRAPH_COLLECTIVES`` remain, only as overrides of whatever the options say (for
switching a job without editing it); they are read when a switch is used, so a change
takes effect at the next call, and all of them when buffers are built, on every device, so
a value that is not valid is an error there.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

BACKENDS = ("auto", "triton", "te", "torch")


@dataclass(frozen=True)
class BufferOptions:
    """How norms and clips run.

    Attributes:
        backend: fused kernels on CUDA: ``auto`` (Triton when it imports, else
            transformer-engine when it imports, else torch), ``triton``, ``te`` or
            ``torch``. The CPU always uses torch's kernels.
        cuda_graphs: replay the launches of a norm or clip as a CUDA graph from the third
            call on (:mod:`buffers.graphs`).
        graph_collectives: capture an all-reduce over an NCCL group in the same graph
            (otherwise it runs between two replays).
    """

    backend: str = "auto"
    cuda_graphs: bool = True
    graph_collectives: bool = True

    def __post_init__(self) -> None:
        # every switch, a subclass's too: a truthy string ("no") must not turn one on
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.type in ("bool", bool) and not isinstance(value, bool):
                raise TypeError(
                    f"{type(self).__name__}({field.name}={value!r}): expected True or False, "
                    f"not a {type(value).__name__}"
                )
        if self.backend not in BACKENDS:
            raise ValueError(f"backend={self.backend!r}; expected one of {BACKENDS}")

    @property
    def effective_backend(self) -> str:
        """``backend``, unless ``BUFFERS_BACKEND`` overrides it."""
        choice = os.environ.get("BUFFERS_BACKEND") or self.backend
        if choice not in BACKENDS:
            raise ValueError(
                f"the environment variable BUFFERS_BACKEND={choice!r} is not a backend; valid "
                f"values: {', '.join(BACKENDS)} (or unset it)"
            )
        return choice

    @property
    def effective_cuda_graphs(self) -> bool:
        """``cuda_graphs``, unless ``BUFFERS_CUDA_GRAPHS`` (0 or 1) overrides it."""
        return _switch("BUFFERS_CUDA_GRAPHS", self.cuda_graphs)

    @property
    def effective_graph_collectives(self) -> bool:
        """``graph_collectives``, unless ``BUFFERS_GRAPH_COLLECTIVES`` overrides it."""
        return _switch("BUFFERS_GRAPH_COLLECTIVES", self.graph_collectives)

    def check_environment(self) -> None:
        """Read every overriding environment variable: ``ValueError`` naming a bad one.

        Done where buffers are built, on every device: the CPU uses none of these
        switches, and a misspelt value must not wait for the job's move to a GPU.
        """
        _ = self.effective_backend, self.effective_cuda_graphs, self.effective_graph_collectives


def _switch(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    if value not in ("0", "1"):
        raise ValueError(
            f"the environment variable {name}={value!r} is not a switch; valid values: 0 or 1 "
            "(or unset it)"
        )
    return value == "1"


DEFAULT = BufferOptions()
