"""The tests' rank starter (``tests/support/spawn.py``): ranks forked from the preloaded
server get what spawned ones got (the parent's environment, ``sys.path``, working directory,
standard output and error as they are at the start), a rank's failure is raised as
``torch.multiprocessing.spawn`` raises it, and where a fork would not do, ranks are spawned."""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

import pytest

from tests.support import spawn

PRELOADED = "tests.support.cpu_megatron"  # in the server's list; nothing here imports it


def report(rank: int, out: str, var: str) -> None:
    """A rank's view of its process, written to ``out/<rank>.json``; a line on each stream."""
    print(f"rank {rank} on stdout", flush=True)
    print(f"rank {rank} on stderr", file=sys.stderr, flush=True)
    seen = {
        "preloaded": PRELOADED in sys.modules,
        "ppid": os.getppid(),
        "env": os.environ.get(var),
        "test": os.environ.get("PYTEST_CURRENT_TEST"),
        "path": sys.path,
        "cwd": os.getcwd(),
    }
    Path(out, f"{rank}.json").write_text(json.dumps(seen))


def fail(rank: int, how: str) -> None:
    if rank == 1 and how == "raise":
        raise ValueError("rank 1 went wrong")
    if rank == 1 and how == "exit":
        os._exit(3)


@pytest.fixture(scope="module")
def server() -> None:
    """The server started before any test's own capture (as the suite's first spawn does)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback to spawn here would be a bug
        assert spawn.start_method() == "forkserver"


def read(out: Path, world: int) -> list[dict]:
    return [json.loads((out / f"{r}.json").read_text()) for r in range(world)]


def test_ranks_are_forks_of_the_server_with_what_the_parent_has_now(
    server, tmp_path, capfd, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    spawn.spawn(report, args=(str(tmp_path), "HOME"), nprocs=2)
    ranks = read(tmp_path, 2)
    for rank in ranks:
        assert rank["preloaded"] and rank["ppid"] != os.getpid()  # the server's child
        assert rank["env"] == os.environ["HOME"]
        assert rank["test"] == os.environ["PYTEST_CURRENT_TEST"]  # this test, not the first
        assert rank["path"] == sys.path and rank["cwd"] == str(tmp_path)
    assert ranks[0]["ppid"] == ranks[1]["ppid"]
    out, err = capfd.readouterr()  # this test's capture, which the server never had
    assert sorted(out.splitlines()) == ["rank 0 on stdout", "rank 1 on stdout"]
    assert sorted(err.splitlines()) == ["rank 0 on stderr", "rank 1 on stderr"]


def test_a_process_is_started_as_the_ranks_are(server, tmp_path, capfd):
    p = spawn.process(report, args=(5, str(tmp_path), "HOME"))
    p.start()
    p.join(timeout=60)
    assert p.exitcode == 0
    (seen,) = [json.loads((tmp_path / "5.json").read_text())]
    assert seen["preloaded"] and seen["test"] == os.environ["PYTEST_CURRENT_TEST"]
    assert capfd.readouterr() == ("rank 5 on stdout\n", "rank 5 on stderr\n")


def test_a_ranks_exception_or_exit_status_is_raised_here(server):
    import torch.multiprocessing as mp

    with pytest.raises(mp.ProcessRaisedException, match="ValueError: rank 1 went wrong"):
        spawn.spawn(fail, args=("raise",), nprocs=2)
    with pytest.raises(mp.ProcessExitedException, match="exit code 3") as exc:
        spawn.spawn(fail, args=("exit",), nprocs=2)
    assert exc.value.error_index == 1


def test_a_changed_environment_gets_fresh_interpreters_and_a_warning(server, tmp_path, monkeypatch):
    monkeypatch.setenv("SPAWN_TEST_VARIABLE", "read at import")
    with pytest.warns(UserWarning, match=r"\['SPAWN_TEST_VARIABLE'\] differ"):
        spawn.spawn(report, args=(str(tmp_path), "SPAWN_TEST_VARIABLE"), nprocs=1)
    (rank,) = read(tmp_path, 1)
    assert not rank["preloaded"] and rank["env"] == "read at import"


@pytest.mark.parametrize("value", ["/elsewhere", None], ids=["changed", "removed"])
def test_a_variable_changed_or_removed_since_the_server_started_is_seen(server, monkeypatch, value):
    if value is None:
        monkeypatch.delenv("HOME")
    else:
        monkeypatch.setenv("HOME", value)
    with pytest.warns(UserWarning, match=r"\['HOME'\] differ"):
        assert spawn.start_method() == "spawn"
    monkeypatch.undo()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert spawn.start_method() == "forkserver"  # back as the server has it


def test_the_attention_backends_variables_keep_the_server(server, monkeypatch):
    """megatron-core sets NVTE_FLASH_ATTN & co. when a language model is built in the
    test process (read at import only by transformer-engine, which the server never
    imports): the ranks still fork from the server, without a warning."""
    monkeypatch.setenv("NVTE_FLASH_ATTN", "0")
    monkeypatch.setenv("NVTE_FUSED_ATTN", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert spawn.start_method() == "forkserver"


def test_where_torch_sees_a_gpu_ranks_are_spawned(server, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert spawn.start_method() == "spawn"
    assert spawn.context().get_start_method() == "spawn"
