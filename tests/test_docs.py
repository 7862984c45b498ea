"""The README and docs/: every command in a code block runs somewhere, and every link resolves.

A fenced block is ``python``, ``bash`` or ``text`` (output, not run). The line right above
its opening fence may carry one annotation:

- ``<!-- doc-test: gpu-only: REASON -->``: not run here (REASON says why and what runs it);
- ``<!-- doc-test: continues -->``: a python block run after the file's previous python
  block, in the same process (it uses that block's names).

Python blocks without ``gpu-only`` are run here on the CPU. Each command of a bash block
without ``gpu-only`` must be listed in ``WHERE_RUN``: run by CI (the line is in ``.ci/run``)
or by a named test, which must exist. A new command, or one in a new docs file, fails
``test_every_command_is_run_by_a_test_or_ci`` until it is listed or marked. Commands in
running text (between backticks) are not checked. The two run records, RESULTS.md and
gpu-test-log.md, quote commands as history: only their links are checked.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.mcore

ROOT = Path(__file__).resolve().parents[1]
RECORDS = {"RESULTS.md", "gpu-test-log.md"}
DOC_FILES = [ROOT / "README.md"] + [
    p for p in sorted((ROOT / "docs").glob("*.md")) if p.name not in RECORDS
]
ALL_MARKDOWN = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LANGS = {"python", "bash", "text"}
FETCH_TEST = "tests/test_docs.py::test_the_fetch_block_runs_against_a_local_megatron_lm"
# Each command of a bash block (quotes and comments as the shell reads them) -> where it runs.
WHERE_RUN = {
    "bash scripts/main.sh": "ci",
    "bash scripts/test.sh": "ci",
    "bash scripts/fetch_megatron_lm.sh": FETCH_TEST,
    "export MEGATRON_LM_PATH=$PWD/.megatron-lm": FETCH_TEST,
}
ANNOTATION = re.compile(r"^<!-- doc-test: (.*?) -->$")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    lang: str
    text: str
    annotation: str | None

    def __str__(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    @property
    def gpu_only(self) -> bool:
        return (self.annotation or "").startswith("gpu-only:")


def blocks(path: Path) -> list[Block]:
    """The fenced code blocks of a markdown file, each with the annotation above it."""
    lines = path.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        if lines[i].startswith("```"):
            lang, start = lines[i][3:].strip(), i
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            above = ANNOTATION.match(lines[i - 1].strip()) if i else None
            text = "\n".join(lines[i + 1 : end]) + "\n"
            found.append(Block(path, start + 1, lang, text, above and above.group(1)))
            i = end
        i += 1
    return found


def commands(block: Block) -> list[str]:
    """A bash block's commands, one per logical line, as the shell splits them."""
    logical = block.text.replace("\\\n", " ")
    out = []
    for line in logical.splitlines():
        words = shlex.split(line, comments=True)
        if words:
            out.append(" ".join(words))
    return out


def uncovered(doc_blocks: list[Block]) -> list[str]:
    """Commands in bash blocks that are neither listed in WHERE_RUN nor marked gpu-only."""
    return [
        f"{b}: {cmd}"
        for b in doc_blocks
        if b.lang == "bash" and not b.gpu_only
        for cmd in commands(b)
        if cmd not in WHERE_RUN
    ]


DOC_BLOCKS = [b for p in DOC_FILES for b in blocks(p)]


def test_every_block_has_a_known_language_and_annotation():
    for b in DOC_BLOCKS:
        assert b.lang in LANGS, f"{b}: fence language {b.lang!r}; use one of {sorted(LANGS)}"
        if b.annotation is None:
            continue
        if b.gpu_only:
            assert b.annotation.split(":", 1)[1].strip(), f"{b}: gpu-only needs a reason"
            assert b.lang != "text", f"{b}: a text block is never run"
        else:
            assert b.annotation == "continues" and b.lang == "python", f"{b}: {b.annotation}"


def test_every_command_is_run_by_a_test_or_ci():
    missing = uncovered(DOC_BLOCKS)
    assert not missing, (
        "commands in the docs that no test or CI runs: list each in tests/test_docs.py "
        "WHERE_RUN (after making a test or .ci/run run it), or mark its block "
        "<!-- doc-test: gpu-only: REASON -->:\n" + "\n".join(missing)
    )


def test_a_new_command_is_caught_and_a_gpu_only_one_is_not():
    new = Block(ROOT / "README.md", 1, "bash", "bash scripts/main.sh\npython new.py  # x\n", None)
    assert uncovered([new]) == ["README.md:1: python new.py"]
    assert uncovered([Block(new.path, 1, "bash", new.text, "gpu-only: reason")]) == []


def test_where_run_names_real_ci_steps_and_tests():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    for cmd, where in WHERE_RUN.items():
        if where == "ci":
            assert cmd in ci, f"{cmd!r} is not a line of .ci/run"
        else:
            path, name = where.split("::")
            assert f"def {name}(" in (ROOT / path).read_text(), where


def _python_chains() -> list[tuple[str, str]]:
    chains: list[tuple[str, str]] = []
    for path in DOC_FILES:
        for b in blocks(path):
            if b.lang != "python" or b.gpu_only:
                continue
            if b.annotation == "continues":
                assert chains and chains[-1][0].startswith(str(path.relative_to(ROOT))), b
                chains[-1] = (f"{chains[-1][0]}+{b.line}", chains[-1][1] + b.text)
            else:
                chains.append((str(b), b.text))
    return chains


@pytest.mark.parametrize("where,code", _python_chains(), ids=[c[0] for c in _python_chains()])
def test_python_blocks_run_on_the_cpu(where, code, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"{where}:\n{proc.stderr[-3000:]}"


def _git(*args: str, cwd: Path) -> None:
    ident = ["-c", "user.name=docs-test", "-c", "user.email=docs-test@localhost"]
    subprocess.run(["git", *ident, *args], cwd=cwd, check=True, capture_output=True)


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_the_fetch_block_runs_against_a_local_megatron_lm(tmp_path):
    # A stand-in Megatron-LM repository with the four files at the default tag; the block
    # runs in a copy of the project's layout, so the real .megatron-lm/ is left alone.
    repo, project = tmp_path / "megatron-lm", tmp_path / "project"
    repo.mkdir()
    for name in ("pretrain_gpt.py", "gpt_builders.py", "model_provider.py", "LICENSE"):
        (repo / name).write_text(f"# {name}\n")
    _git("init", "-q", cwd=repo)
    _git("add", ".", cwd=repo)
    _git("commit", "-q", "-m", "stand-in", cwd=repo)
    _git("tag", "core_v0.19.0", cwd=repo)
    (project / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "fetch_megatron_lm.sh", project / "scripts")
    fetch_blocks = [b for b in DOC_BLOCKS if FETCH_TEST in map(WHERE_RUN.get, commands(b))]
    assert len(fetch_blocks) >= 2  # the README's and docs/megatron-lm.md's
    env = {**os.environ, "MEGATRON_LM_GIT": str(repo)}
    for b in fetch_blocks:
        assert all(WHERE_RUN.get(c) == FETCH_TEST for c in commands(b)), b
        script = b.text + 'test -f "$MEGATRON_LM_PATH/pretrain_gpt.py"\n'
        proc = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", script],
            cwd=project,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, f"{b}:\n{proc.stdout}{proc.stderr}"
        assert (project / ".megatron-lm" / "REF").read_text().startswith("core_v0.19.0 ")


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to dashes."""
    text = heading.strip().lower().replace("`", "")
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = "\n".join(b for b in re.split(r"^```.*$", path.read_text(), flags=re.M)[::2])
    return {_slug(m.group(1)) for m in re.finditer(r"^#+ (.*)$", text, flags=re.M)}


@pytest.mark.parametrize("path", ALL_MARKDOWN, ids=lambda p: p.name)
def test_relative_links_resolve(path):
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading with that anchor")
    assert not broken, f"{path.relative_to(ROOT)}: " + "; ".join(broken)


def test_the_readme_is_short_and_keeps_the_two_commands():
    readme = ROOT / "README.md"
    assert len(readme.read_text().splitlines()) <= 200
    first = next(b for b in blocks(readme) if b.lang == "bash")
    assert commands(first) == ["bash scripts/main.sh", "bash scripts/test.sh"]


def test_the_optimizer_matrix_is_whole_in_one_file():
    text = (ROOT / "docs" / "guarantees.md").read_text()
    section = text.split("## The optimizer matrix", 1)[1].split("\n## ", 1)[0]
    rows = [
        line
        for line in section.splitlines()
        if line.startswith("| bf16") or line.startswith("| fp16")
    ]
    assert len(rows) == 20


def test_the_supported_megatron_core_versions_are_stated_once_as_pyproject_pins_them():
    import tomllib

    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet

    from megatron_ext import seam

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    # an extra: a plain-PyTorch user installs torch alone
    assert all(Requirement(d).name != "megatron-core" for d in project["dependencies"])
    [pins] = [
        Requirement(d).specifier
        for d in project["optional-dependencies"]["megatron"]
        if Requirement(d).name == "megatron-core"
    ]
    stated = re.compile(r"megatron-core\s*((?:[<>=!~]=?\s*\d[\w.]*(?:,\s*)?)+)")
    versions = (ROOT / "docs" / "versions.md").read_text()
    [found] = stated.findall(versions)
    assert SpecifierSet(found.replace(" ", "").rstrip(",")) == pins, found
    # the one source: any other range in the docs is a second one that can drift
    elsewhere = {
        str(path.relative_to(ROOT)): stated.findall(path.read_text())
        for path in DOC_FILES
        if path.name != "versions.md"
    }
    assert {k: v for k, v in elsewhere.items() if v} == {}
    low, high = (".".join(map(str, v)) for v in seam.SUPPORTED)  # import's own check
    assert pins == SpecifierSet(f">={low},<={high}")


# How a document came to be written, or a path outside the repository
CIRCUMSTANCES = re.compile(
    r"\.\./shared|/work/|\b(?:this|next|that|the|first|second|third|fourth|fifth|sixth|"
    r"seventh|eighth|ninth) (?:GPU )?session\b|\bsession's\b|\bdevice time (?:was|is|ran|left)"
    r"|\bno device time\b",
    re.IGNORECASE,
)


@pytest.mark.parametrize("path", ALL_MARKDOWN, ids=lambda p: str(p.relative_to(ROOT)))
def test_documents_speak_of_the_project_only(path):
    found = [
        f"{n}: {m.group(0)!r}"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        for m in CIRCUMSTANCES.finditer(line)
    ]
    assert not found, f"{path.relative_to(ROOT)}: " + "; ".join(found)
