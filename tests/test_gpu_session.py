"""scripts/gpu_session.sh's reshard step, wired on the CPU with a python3 that records how
it was called."""

import subprocess
from pathlib import Path

from tests.support.gpu_session_stub import stub_repo

# what each python3 call of the stub records, before its arguments
RECORDS = "DEVICE=${MEGATRON_TEST_DEVICE:-} PYTHONPATH=${PYTHONPATH:-}"


def test_the_reshard_step_runs_the_cpu_resharding_files_on_cuda(tmp_path):
    """MEGATRON_TEST_DEVICE=cuda, tests/support/multirank first on PYTHONPATH (collectives
    one by one for gloo on CUDA tensors), the CPU suite's DP, TP and PP files themselves."""
    root, log, out, env = stub_repo(tmp_path, RECORDS)
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
    root, log, out, env = stub_repo(tmp_path, RECORDS)
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
    root, log, out, env = stub_repo(tmp_path, RECORDS)
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


def test_the_scale_step_runs_one_size_with_deepspeed_on_its_own_path(tmp_path):
    """SCALE_ARGS is required and passed whole; DeepSpeed's wheels, when carried in
    .whl/deepspeed/, go to /tmp/ds-site, which this step alone has on PYTHONPATH (after the
    others) and its bin/ (ninja) first on PATH; the table's end follows the step's line."""
    root, log, out, env = stub_repo(tmp_path, RECORDS)
    python3 = tmp_path / "bin" / "python3"
    python3.write_text(
        '#!/usr/bin/env bash\necho "PATH=${PATH%%:*} PYTHONPATH=${PYTHONPATH:-} $*" >> '
        '"$STUB_LOG"\nps -o args= -p $PPID >> "$STUB_LOG.parent"\necho "scale table line"\n'
    )
    env.pop("SCALE_ARGS", None)
    proc = subprocess.run(["bash", "scripts/gpu_session.sh", "scale"], cwd=root, env=env,
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode != 0 and "scale step: set SCALE_ARGS" in proc.stderr
    env["SCALE_ARGS"] = "--size 6.7b --kinds fwd_bwd exact"
    proc = subprocess.run(["bash", "scripts/gpu_session.sh", "scale"], cwd=root, env=env,
                          capture_output=True, text=True)  # fmt: skip
    assert "=== scale exit 0" in proc.stdout, proc.stdout + proc.stderr
    assert proc.stdout.rstrip().endswith("scale table line")  # the log's end, shown
    calls = log.read_text().splitlines()
    assert not any("/tmp/ds-site" in c for c in calls[:-1])  # no DeepSpeed carried: none
    assert calls[-1] == (
        f"PATH=/tmp/ds-site/bin PYTHONPATH=/tmp/site:{root}:/tmp/ds-site "
        f"benchmarks/offload_scale.py --device cuda --out {out}/bench --size 6.7b --kinds "
        "fwd_bwd exact"
    )
    parents = Path(f"{log}.parent")
    assert parents.read_text().splitlines()[-1].startswith("timeout 540 python3 benchmarks/")
    (root / ".whl" / "deepspeed").mkdir()
    (root / ".whl" / "deepspeed" / "deepspeed-0.19.8-py3-none-any.whl").write_bytes(b"w")
    env["SCALE_LIMIT"] = "7"
    proc = subprocess.run(["bash", "scripts/gpu_session.sh", "scale"], cwd=root, env=env,
                          capture_output=True, text=True)  # fmt: skip
    assert "=== scale exit 0" in proc.stdout, proc.stdout + proc.stderr
    install = log.read_text().splitlines()[-2]
    assert install.endswith(
        "-m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade "
        "--target /tmp/ds-site .whl/deepspeed/deepspeed-0.19.8-py3-none-any.whl"
    ), install
    assert (out / "scale.log").read_text() == "scale table line\n"
    assert parents.read_text().splitlines()[-1].startswith("timeout 7 python3 benchmarks/")
