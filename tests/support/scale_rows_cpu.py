"""``benchmarks/offload_scale.py --row KIND`` on the CPU: megatron-core's DDP and optimizers
on the CPU shim (``tests/support/cpu_megatron.py``), the benchmark's GPT as
``tests/test_offload_overlap_gpt_cpu.py`` runs it (megatron-core's offload placement
replayed, host generators). The GPU-resident kind runs megatron-core's optimizer without the
precision-aware path (that needs transformer-engine); the offloaded kinds keep it.

Usage: python tests/support/scale_rows_cpu.py <offload_scale.py's arguments, --row KIND>
"""

from __future__ import annotations

import sys
import tempfile
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main(argv: list[str]) -> None:
    import torch.distributed as dist

    warnings.simplefilter("ignore")  # megatron-core's import-time notes about TE and Apex
    from benchmarks import offload_overlap, offload_scale
    from tests.support.cpu_megatron import cpu_megatron
    from tests.support.gpt_on_the_cpu import _gpt_on_the_cpu

    kind = argv[argv.index("--row") + 1]
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        try:
            with cpu_megatron(), _gpt_on_the_cpu() as patch:
                if kind != "gpu_resident":  # offloaded: the precision-aware path needs no TE
                    patch.setattr(offload_overlap, "PA", dict(use_precision_aware_optimizer=True))
                offload_scale.main(argv)
        finally:
            dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
