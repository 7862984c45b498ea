"""transformer-engine for the offline GPU machine: scripts/fetch_te.sh and scripts/install_te.sh
(through scripts/gpu_session.sh's ``te`` step), wired end to end on the CPU.

A stand-in ``python3`` records every call and plays pip: ``download`` writes files named as
PyPI's would be (the core wheel random bytes, the torch extension a real source tarball),
``wheel`` writes the built extension, ``install`` and ``-c`` only record. What the scripts do
with those files (cut, stash, join, checksum, one install call) runs for real.
"""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ("fetch_te.sh", "install_te.sh", "gpu_session.sh")
CORE = "transformer_engine_cu13-2.20.2-py3-none-manylinux_2_28_x86_64.whl"

STUB = r'''#!PYTHON
"""pip's stand-in: records argv, writes what pip would."""
import io, os, sys, tarfile
from pathlib import Path

with open(os.environ["STUB_LOG"], "a") as log:
    log.write(" ".join(sys.argv[1:]) + "\n")
args = sys.argv[1:]
if args[:1] == ["-c"]:
    print("TE ready: stand-in")
    sys.exit(0)
assert args[:2] == ["-m", "pip"], args
if args[2] == "download":
    valued = {"-d", "--python-version", "--implementation", "--platform", "--only-binary"}
    dest, specs, i = None, [], 3
    while i < len(args):
        if args[i] in valued:
            dest = args[i + 1] if args[i] == "-d" else dest
            i += 2
            continue
        if not args[i].startswith("-"):
            specs.append(args[i])
        i += 1
    for spec in specs:
        name, version = spec.split("==")
        stem = name.replace("-", "_") + "-" + version
        if name == "transformer-engine-torch":  # source only, as on PyPI
            with tarfile.open(Path(dest, stem + ".tar.gz"), "w:gz") as tar:
                info = tarfile.TarInfo(stem + "/setup.py")
                tar.addfile(info, io.BytesIO(b""))
        elif name == "transformer-engine-cu13":
            Path(dest, stem + "-py3-none-manylinux_2_28_x86_64.whl").write_bytes(
                Path(os.environ["STUB_CORE"]).read_bytes())
        else:
            Path(dest, stem + "-py3-none-any.whl").write_bytes(b"wheel")
elif args[2] == "wheel":
    out = Path(args[args.index("-w") + 1])
    assert Path.cwd().name.startswith("transformer_engine_torch-"), Path.cwd()
    (out / "transformer_engine_torch-2.20.2-cp312-cp312-linux_x86_64.whl").write_bytes(b"x")
'''


@pytest.fixture
def site(tmp_path):
    """A copy of the repository's scripts, a recording python3 first on PATH, and the bytes
    of a core wheel of 2.5 MiB."""
    root = tmp_path / "repo"
    (root / "scripts").mkdir(parents=True)
    for name in SCRIPTS:
        shutil.copy(ROOT / "scripts" / name, root / "scripts" / name)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stub = bin_dir / "python3"
    stub.write_text(STUB.replace("PYTHON", sys.executable, 1))
    stub.chmod(0o755)
    core = tmp_path / "core.whl"
    core.write_bytes(random.Random(7).randbytes(5 * 2**19))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TE_", "PYTHON"))}
    env |= {
        "PATH": f"{bin_dir}:{env['PATH']}",
        "STUB_LOG": str(tmp_path / "calls.log"),
        "STUB_CORE": str(core),
        "TE_STASH": str(tmp_path / "stash"),
        "TE_SITE": str(tmp_path / "site"),
        "TE_BUILD": str(tmp_path / "build"),
        "TE_PART_MIB": "1",
    }
    return root, env, core


def bash(root, env, *args, check=True):
    proc = subprocess.run(
        ["bash", *args], cwd=root, env=env, capture_output=True, text=True, timeout=60
    )
    if check:
        assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def calls(env) -> list[str]:
    path = Path(env["STUB_LOG"])
    return path.read_text().splitlines() if path.exists() else []


@pytest.mark.parametrize("name", SCRIPTS)
def test_the_scripts_parse(name):
    proc = subprocess.run(["bash", "-n", str(ROOT / "scripts" / name)], capture_output=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("name", ["fetch_te.sh", "install_te.sh"])
def test_help_says_where_things_go_and_runs_nothing(name, site):
    root, env, _ = site
    out = bash(root, env, f"scripts/{name}", "--help").stdout
    assert out.startswith(f"usage: bash scripts/{name}")
    assert ".te/" in out  # where the downloads are
    for variable in {
        "fetch_te.sh": ["TE_VERSION", "TE_PART_MIB", "PYTHON"],
        "install_te.sh": ["TE_STASH", "TE_SITE", "TE_BUILD", "PYTHON"],
    }[name]:
        assert variable in out, variable
    assert calls(env) == [] and not (root / ".te").exists()


def test_fetch_cuts_the_core_wheel_into_parts_that_join_back_to_it(site):
    root, env, core = site
    bash(root, env, "scripts/fetch_te.sh")
    te = root / ".te"
    parts = sorted(te.glob("p*/part"))
    assert [p.parent.name for p in parts] == ["p0", "p1", "p2"]  # 2.5 MiB in 1 MiB parts
    assert all(p.stat().st_size <= 2**20 for p in parts)
    assert b"".join(p.read_bytes() for p in parts) == core.read_bytes()
    deps = te / "deps"
    assert (deps / "CORE_WHEEL").read_text().strip() == CORE
    assert (deps / "CORE_SHA256").read_text().strip() == hashlib.sha256(
        core.read_bytes()
    ).hexdigest()
    assert (deps / "transformer_engine_torch-2.20.2.tar.gz").is_file()
    assert (deps / "transformer_engine-2.20.2-py3-none-any.whl").is_file()
    downloads = [c for c in calls(env) if c.startswith("-m pip download")]
    binary = [c for c in downloads if "torch==" not in c]
    # for the GPU machine's interpreter and platform, whatever runs pip here
    assert binary and all("--python-version 3.12" in c and "manylinux" in c for c in binary)


def test_parts_stashed_one_transfer_at_a_time_then_the_te_step_installs_them(site, tmp_path):
    root, env, core = site
    bash(root, env, "scripts/fetch_te.sh")
    held = tmp_path / "held"  # what has not been transferred yet
    shutil.move(root / ".te", held)
    (root / ".te").mkdir()
    for n in (0, 1):  # one part per transfer, nothing else carried
        shutil.copytree(held / f"p{n}", root / ".te" / f"p{n}")
        out = bash(root, env, "scripts/install_te.sh", "stash").stdout
        assert f"stashed p{n}" in out
        shutil.rmtree(root / ".te" / f"p{n}")
    # the last transfer: the last part, the dependencies and megatron-core's wheel
    shutil.copytree(held / "p2", root / ".te" / "p2")
    shutil.copytree(held / "deps", root / ".te" / "deps")
    (root / ".whl").mkdir()
    (root / ".whl" / "megatron_core-0.19.2-py3-none-any.whl").write_bytes(b"w")
    before = len(calls(env))
    env_out = env | {"OUT": str(tmp_path / "out")}
    # (its status is that of its last summary grep: the step's status is in its output)
    out = bash(root, env_out, "scripts/gpu_session.sh", "te", check=False).stdout
    assert "=== te exit 0" in out, out + (tmp_path / "out" / "te.log").read_text()
    log = (tmp_path / "out" / "te.log").read_text()
    assert "checksum matches (parts p0 p1 p2 )" in log and "TE ready" in log
    joined = Path(env["TE_STASH"]) / CORE
    assert joined.read_bytes() == core.read_bytes()
    made = calls(env)[before:]
    [build] = [c for c in made if c.startswith("-m pip wheel")]
    assert "--no-build-isolation" in build  # against the machine's torch
    installs = [c for c in made if c.startswith("-m pip install") and "transformer_engine" in c]
    # core, meta and extension in one call (separate --target installs replace each other)
    assert len(installs) == 1 and str(joined) in installs[0]
    assert "transformer_engine-2.20.2-py3-none-any.whl" in installs[0]
    assert "transformer_engine_torch-2.20.2-cp312" in installs[0]
    assert f"--target {env['TE_SITE']}" in installs[0]


def test_a_missing_part_is_refused_naming_what_was_stashed(site, tmp_path):
    root, env, _ = site
    bash(root, env, "scripts/fetch_te.sh")
    shutil.rmtree(root / ".te" / "p1")
    proc = bash(root, env, "scripts/install_te.sh", check=False)
    assert proc.returncode == 1
    assert "stashed parts (p0 p2 )" in proc.stderr and "stash every part" in proc.stderr
    assert not any("pip install" in c for c in calls(env))


def test_dry_run_checks_the_wheel_and_prints_the_commands_without_running_them(site):
    root, env, _ = site
    bash(root, env, "scripts/fetch_te.sh")
    before = len(calls(env))
    out = bash(root, env, "scripts/install_te.sh", "--dry-run").stdout
    assert "checksum matches (parts p0 p1 p2 )" in out and "dry run: nothing installed" in out
    assert out.count("would run:") >= 4 and "pip wheel" in out
    assert calls(env)[before:] == [] and not Path(env["TE_BUILD"]).exists()
