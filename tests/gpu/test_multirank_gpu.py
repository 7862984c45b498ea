"""Several ranks on the one GPU: DP 2 and 4, TP, EP/ETP, PP, loss scaling, every optimizer.

Each world size is one ``torchrun`` of ``multirank_worker.py`` (gloo on CUDA tensors, with
``tests/support/multirank`` first on ``PYTHONPATH``); the worker checks every configuration
on every rank (its docstring says how) and writes its findings, which the tests here read.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

HERE = Path(__file__).resolve().parent
SUPPORT = HERE.parent / "support" / "multirank"
sys.path.insert(0, str(HERE))
from multirank_worker import CONFIGS  # noqa: E402

_RUNS: dict[int, dict] = {}


def results_for(world: int, tmp_root: Path) -> dict:
    """Run every configuration of this world size once (cached); per config, per rank."""
    if world not in _RUNS:
        out = tmp_root / f"world{world}"
        out.mkdir(parents=True, exist_ok=True)
        names = [n for n, c in CONFIGS.items() if c["world"] == world and selected(n)]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            [str(SUPPORT), str(HERE.parent.parent), env.get("PYTHONPATH", "")]
        )
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={world}", str(HERE / "multirank_worker.py"),
               "--out", str(out), *names]  # fmt: skip
        proc = subprocess.run(
            cmd,
            env=env,
            capture_output=True,
            text=True,
            timeout=int(os.environ.get("MULTIRANK_TIMEOUT", "420")),
        )
        print(proc.stdout[-6000:], proc.stderr[-6000:])
        runs = {}
        for r in range(world):
            path = out / f"rank{r}.json"
            runs[r] = json.loads(path.read_text()) if path.exists() else {}
        _RUNS[world] = {"rc": proc.returncode, "log": proc.stderr[-3000:], "ranks": runs}
    return _RUNS[world]


def selected(name: str) -> bool:
    """MULTIRANK_ONLY (a substring of configuration names) runs only those."""
    return os.environ.get("MULTIRANK_ONLY", "") in name


@pytest.mark.parametrize("name", list(CONFIGS))
def test_configuration_at_several_ranks(name, tmp_path_factory):
    if not selected(name):
        pytest.skip("not selected by MULTIRANK_ONLY")
    world = CONFIGS[name]["world"]
    run = results_for(world, tmp_path_factory.getbasetemp())
    failures = {}
    for rank, results in run["ranks"].items():
        if name not in results:
            failures[rank] = [f"no result (torchrun exit {run['rc']}): {run['log']}"]
        elif results[name]["failures"]:
            failures[rank] = results[name]["failures"]
    assert not failures, json.dumps(failures, indent=1)[:8000]
    facts = run["ranks"][0][name]["facts"]
    print(name, json.dumps(facts, default=str)[:2000])
    assert facts["ours"], "no step ran"
