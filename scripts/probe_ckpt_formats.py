"""Probe (CUDA only): what each distributed-optimizer checkpoint format does, option on/off.

For every format megatron-core 0.19.2 names (``fully_reshardable``, ``dp_reshardable``,
``dp_zero_gather_scatter``, ``fully_sharded_model_space``), on torch's Adam and on
megatron-core's Apex code path (``tests/gpu/apex_standin.py``), in all four directions
(saved with the option on/off, loaded with it on/off): save after three steps, load into a
fresh model, compare every parameter and optimizer state tensor, train three more steps
and compare the parameters with the run that saved. Prints one line per case: ``identical``,
``DIFFERS`` (the first difference), or the exception. Uses the GPU reliability tests'
helpers. Run on the GPU machine after ``gpu_session.sh`` installed megatron-core:
``PYTHONPATH=/tmp/site:$PWD python3 scripts/probe_ckpt_formats.py``.
"""

import sys
import tempfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "gpu"))
import apex_standin  # noqa: E402
import test_reliability_gpu as rel  # noqa: E402

from benchmarks import common  # noqa: E402

FORMATS = ["fully_reshardable", "dp_reshardable", "dp_zero_gather_scatter"]
FORMATS += ["fully_sharded_model_space"]


def first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:150] if text else ''}"


def case(tmp: Path, fmt: str, saved_with: bool, loaded_with: bool, apex: bool) -> str:
    model, opt = rel.build(saved_with, clip_grad=1e9)
    rel.train(model, opt, 3)
    try:
        rel.save(model, opt, tmp / "ckpt", fmt)
    except Exception as e:  # noqa: BLE001 - the outcome is what is printed
        return "save: " + first_line(e)
    want_params, want_state = rel.params_of(model), rel.optimizer_state(opt)
    other, other_opt = rel.build(loaded_with, seed=1, clip_grad=1e9)
    if not apex:
        rel.train(other, other_opt, 1, first_step=50)  # torch Adam needs a "step" first
    try:
        rel.load_and_compare(other, other_opt, tmp / "ckpt", fmt, want_params, want_state)
    except AssertionError as e:  # the tests' own comparison: first difference
        return "DIFFERS after loading: " + first_line(e)
    except Exception as e:  # noqa: BLE001
        return "load: " + first_line(e)
    rel.train(model, opt, 3, first_step=3)
    try:
        rel.train(other, other_opt, 3, first_step=3)
    except Exception as e:  # noqa: BLE001
        return "train after loading: " + first_line(e)
    want = rel.params_of(model)
    after = [n for n, p in rel.params_of(other).items() if not torch.equal(p, want[n])]
    return f"DIFFERS after 3 more steps: {after}" if after else "identical, 3 more steps too"


def main():
    from megatron.core import parallel_state as ps

    with (
        tempfile.TemporaryDirectory() as tmp,
        common.single_rank_process_group(f"file://{tmp}/store"),
    ):
        ps.initialize_model_parallel()
        probe_all()
        ps.destroy_model_parallel()


def probe_all():
    for apex in (False, True):
        with pytest.MonkeyPatch.context() as mp:
            if apex:
                apex_standin.use_apex_path(mp)
            for fmt in FORMATS:
                for saved_with, loaded_with in rel.DIRECTIONS:
                    name = f"{'on' if saved_with else 'off'}->{'on' if loaded_with else 'off'}"
                    with tempfile.TemporaryDirectory() as tmp:
                        out = case(Path(tmp), fmt, saved_with, loaded_with, apex)
                    path = "apex " if apex else "torch"
                    print(f"{path} {fmt:26s} {name:8s} {out}", flush=True)


if __name__ == "__main__":
    main()
