"""Landing the delayed offloaded update of a whole optimizer, as its next step would
([Note: the delayed offloaded update] in :mod:`megatron_ext.offload.chunked`)."""

from __future__ import annotations

from .offload.hybrid import HostMirrorHybridOptimizer


def drain_offload(optimizer) -> int:
    """Land every delayed offloaded update in flight under ``optimizer`` (a chain or one
    optimizer), as its next step would: the host update waited for, its parameters sent to
    the device, and megatron-core's copy of main parameters into the model's.

    Call it where the model's parameters are read outside the training loop (evaluation,
    export, the end of training) and when the loop leaves by an exception; a checkpoint
    save drains by itself. Returns how many updates it landed.
    """
    landed = 0
    for child in getattr(optimizer, "chained_optimizers", [optimizer]):
        hdo = getattr(child, "optimizer", None)
        if isinstance(hdo, HostMirrorHybridOptimizer) and hdo.drain():
            landed += 1
            child._copy_main_params_to_model_params()
    return landed
