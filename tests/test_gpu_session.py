"""scripts/gpu_session.sh's reshard step, wired on the CPU with a python3 that records how
it was called."""

import os
import shutil
import subprocess
from pathlib import Path

RECORDING_PYTHON = r"""#!/usr/bin/env bash
echo "DEVICE=${MEGATRON_TEST_DEVICE:-} PYTHONPATH=${PYTHONPATH:-} $*" >> "$STUB_LOG"
"""


def stub_repo(tmp_path):
    """A scratch copy of gpu_session.sh with a wheel to install and a python3 on PATH that
    records how it was called: (root, call log, $OUT, environment)."""
    root = tmp_path / "repo"
    (root / "scripts").mkdir(parents=True)
    (root / ".whl").mkdir()
    (root / ".whl" / "megatron_core-0.19.2-py3-none-any.whl").write_bytes(b"w")
    shutil.copy(Path(__file__).resolve().parents[1] / "scripts" / "gpu_session.sh",
                root / "scripts")  # fmt: skip
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(RECORDING_PYTHON)
    (bin_dir / "python3").chmod(0o755)
    log, out = tmp_path / "calls", tmp_path / "out"
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
               STUB_LOG=str(log), OUT=str(out))  # fmt: skip
    return root, log, out, env


def test_the_reshard_step_runs_the_cpu_resharding_files_on_cuda(tmp_path):
    """MEGATRON_TEST_DEVICE=cuda, tests/support/multirank first on PYTHONPATH (collectives
    one by one for gloo on CUDA tensors), the CPU suite's DP, TP and PP files themselves."""
    root, log, out, env = stub_repo(tmp_path)
    env.pop("MEGATRON_TEST_DEVICE", None)
    proc = subprocess.run(["bash", "scripts/gpu_session.sh", "reshard"], cwd=root, env=env,
                          capture_output=True, text=True)  # fmt: skip
    assert "=== reshard exit 0" in proc.stdout, proc.stdout + proc.stderr
    install, reshard = log.read_text().splitlines()
    assert "pip install" in install
    assert reshard.startswith(f"DEVICE=cuda PYTHONPATH={root}/tests/support/multirank:/tmp/site:")
    assert reshard.endswith(
        "-m pytest -p no:cacheprovider -q -rfEs tests/test_megatron_cpu_reshard.py "
        "tests/test_megatron_cpu_tp.py tests/test_megatron_cpu_pp.py"
    )
    assert (out / "reshard.log").exists()


def test_the_offload_overlap_step_runs_the_benchmark_with_its_loss_curves(tmp_path):
    """The step runs benchmarks/offload_overlap.py on CUDA into $OUT/bench with 200-step
    loss curves, and OFFLOAD_OVERLAP_ARGS replaces those arguments."""
    root, log, out, env = stub_repo(tmp_path)
    for extra, expected in ((None, "--loss-steps 200"), ("--micro-batches 8", "--micro-batches 8")):
        env.pop("OFFLOAD_OVERLAP_ARGS", None)
        if extra is not None:
            env["OFFLOAD_OVERLAP_ARGS"] = extra
        proc = subprocess.run(["bash", "scripts/gpu_session.sh", "offload_overlap"], cwd=root,
                              env=env, capture_output=True, text=True)  # fmt: skip
        assert "=== offload_overlap exit 0" in proc.stdout, proc.stdout + proc.stderr
        call = log.read_text().splitlines()[-1]
        assert call.endswith(
            f"benchmarks/offload_overlap.py --device cuda --out {out}/bench {expected}"
        ), call


def test_the_overlap_forward_step_runs_the_training_loop_tests_on_cuda(tmp_path):
    """MEGATRON_TEST_DEVICE=cuda, tests/support/multirank first on PYTHONPATH, the
    overlapped and delayed steps' training-loop tests (the CPU suite's files, selected)."""
    root, log, out, env = stub_repo(tmp_path)
    env.pop("MEGATRON_TEST_DEVICE", None)
    proc = subprocess.run(["bash", "scripts/gpu_session.sh", "overlap_forward"], cwd=root,
                          env=env, capture_output=True, text=True)  # fmt: skip
    assert "=== overlap_forward exit 0" in proc.stdout, proc.stdout + proc.stderr
    _, call = log.read_text().splitlines()
    assert call.startswith(f"DEVICE=cuda PYTHONPATH={root}/tests/support/multirank:/tmp/site:")
    assert call.endswith(
        "-m pytest -p no:cacheprovider -q -rfEs tests/test_offload_overlap_forward.py "
        "tests/test_offload_delayed_training.py -k exact_steps_bits or two_ranks or refuses "
        "or training_loop"
    ), call
    assert (out / "overlap_forward.log").exists()
