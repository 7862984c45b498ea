"""The megatron-core version matrix runs exactly the test files that touch megatron-core.

``scripts/mcore_matrix.sh`` runs the files ``scripts/mcore_matrix_tests.py`` lists: those
marked ``pytestmark = pytest.mark.mcore``. Here, read from the files' source alone (nothing
is imported), a test file touches megatron-core when it imports ``megatron`` or
``megatron_ext``, or imports a module of this repository (test support, another test module,
a benchmark) that does, however deep; when it loads or runs a benchmark script that does
(by ``tests.support.bench_scripts.load_script`` or by its file name); or when it, or test
support it imports, hands a child process code or a command line that imports
``megatron_ext`` or ``megatron`` or runs ``-m megatron_ext``. Marked and touching must be
the same files: an unmarked file would never run on the other versions, a marked one that
touches nothing would cost the matrix time for nothing.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import itertools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LOCAL = ("tests", "benchmarks", "buffers")  # packages of this repository, followed inside
TOUCH = ("megatron", "megatron_ext")
GPU = ROOT / "tests" / "gpu"  # test files put it on sys.path to import its drivers by name
SCRIPT = re.compile(r"(?:benchmarks/)?(\w+)\.py")
NAMED = re.compile(r"\b(import|from)\s+megatron(_ext)?\b|-m\s+megatron_ext\b")


def _matrix_tests():
    spec = importlib.util.spec_from_file_location(
        "mcore_matrix_tests", ROOT / "scripts" / "mcore_matrix_tests.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _docstrings(tree: ast.Module) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                out.add(id(body[0].value))
    return out


@functools.cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def referenced(path: Path) -> tuple[set[str], bool]:
    """The modules ``path`` imports or loads anywhere in it, and whether a string it hands
    on (not a docstring) names megatron-core or megatron_ext."""
    tree = _tree(path)
    docs = _docstrings(tree)
    modules: set[str] = set()
    names_it = False
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # from the package the file is in (buffers' modules do this)
                package = path.relative_to(ROOT).parent.parts
                package = package[: len(package) - node.level + 1]
                base = ".".join([*package, base] if base else package)
            modules.add(base)
            modules |= {f"{base}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            first = node.args[0]
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                if name in ("importorskip", "import_module"):
                    modules.add(first.value)
                elif name == "load_script":
                    modules.add(f"benchmarks.{first.value}")
        elif isinstance(node, ast.List | ast.Tuple):  # a command line's [..., "-m", "x"]
            for flag, value in itertools.pairwise(node.elts):
                if (
                    isinstance(flag, ast.Constant)
                    and flag.value == "-m"
                    and isinstance(value, ast.Constant)
                    and isinstance(value.value, str)
                ):
                    modules.add(value.value)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if id(node) in docs:
                continue
            names_it = names_it or bool(NAMED.search(node.value))
    return modules, names_it


def named_scripts(path: Path) -> set[str]:
    """The benchmark scripts ``path`` names by file ("offload.py", "benchmarks/memory.py")."""
    out = set()
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            script = SCRIPT.fullmatch(node.value)
            if script and (ROOT / "benchmarks" / f"{script[1]}.py").is_file():
                out.add(f"benchmarks.{script[1]}")
    return out


def _file_of(module: str) -> Path | None:
    base = ROOT.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


@functools.cache
def _edges(path: Path) -> tuple[bool, tuple[Path, ...]]:
    """Whether ``path`` itself touches megatron-core, and the files of this repository it
    imports or loads."""
    modules, names_it = referenced(path)
    if path.is_relative_to(ROOT / "tests"):  # what the tests hand on; a benchmark's help
        modules |= named_scripts(path)  # text naming other scripts runs nothing
    else:
        names_it = False
    if names_it or any(m.split(".")[0] in TOUCH for m in modules):
        return True, ()
    found = [_file_of(m) for m in sorted(modules) if m.split(".")[0] in LOCAL]
    # a GPU driver imported by its bare name, tests/gpu put first on sys.path by the file
    found += [GPU / f"{m}.py" for m in sorted(modules) if (GPU / f"{m}.py").is_file()]
    return False, tuple(f for f in found if f is not None)


def touches(path: Path) -> bool:
    """Whether ``path`` touches megatron-core (the module docstring's rule)."""
    seen, todo = {path}, [path]
    while todo:
        direct, reached = _edges(todo.pop())
        if direct:
            return True
        todo += [f for f in reached if f not in seen]
        seen.update(reached)
    return False


# this file's own samples of what a file may hand a child are data, not code it runs
TEST_FILES = sorted(p for p in ROOT.glob("tests/test_*.py") if p != Path(__file__).resolve())


def test_the_files_that_touch_megatron_core_are_the_marked_ones():
    marked = set(_matrix_tests().marked_files(ROOT))
    touching = {str(p.relative_to(ROOT)) for p in TEST_FILES if touches(p)}
    fix = "touch megatron-core: mark them pytestmark = pytest.mark.mcore"
    assert sorted(touching - marked) == [], fix
    assert sorted(marked - touching) == [], "marked mcore but touch nothing of megatron-core"


def test_the_rule_follows_imports_and_children(tmp_path):
    # the oracle itself, on files whose answer is known from reading them
    files = {p.name: touches(p) for p in TEST_FILES}
    assert files["test_offload_references.py"]  # through tests.support.offload_sim
    assert files["test_offload_stale_grads.py"]
    assert files["test_benchmarks.py"]  # load_script("memory"): memory.py imports megatron_ext
    assert files["test_notices.py"]  # `import megatron_ext` in a child's code
    assert not files["test_spans.py"] and not files["test_distributed.py"]
    assert not files["test_benchmarks_clip_step.py"]  # its scripts use buffers only
    assert files["test_te_layers_cells.py"]  # `import te_layers_driver`, from tests/gpu


@pytest.mark.parametrize(
    ("source", "modules", "names_it"),
    [
        ("import megatron.core.optimizer as o\n", {"megatron.core.optimizer"}, False),
        ("from tests.support import spawn\n", {"tests.support", "tests.support.spawn"}, False),
        ("def f():\n    import megatron_ext\n", {"megatron_ext"}, False),
        ("pytest.importorskip('megatron.core')\n", {"megatron.core"}, False),
        ("load_script('memory')\n", {"benchmarks.memory"}, False),
        ("run(['python', '-c', 'import megatron_ext'])\n", set(), True),
        ("run(['python', '-m', 'megatron_ext.train'])\n", {"megatron_ext.train"}, False),
        ("run('python -m megatron_ext.train x.py', shell=True)\n", set(), True),
        ("code = f'from megatron.core import {x}'\n", set(), True),
        ('"""import megatron_ext, in a docstring"""\n', set(), False),
        ("why = 'megatron_ext is not a command'\n", set(), False),
    ],
)
def test_what_a_file_references(tmp_path, source, modules, names_it):
    path = tmp_path / "test_x.py"
    path.write_text(source)
    assert referenced(path) == (modules, names_it)


def test_relative_imports_are_resolved_from_the_files_package():
    modules, _ = referenced(ROOT / "buffers" / "ops.py")
    assert {"buffers", "buffers.native", "buffers.options", "buffers.options.DEFAULT"} <= modules


@pytest.mark.parametrize(
    ("source", "want"),
    [
        ("import pytest\npytestmark = pytest.mark.mcore\n", True),
        ("pytestmark = [pytest.mark.slow, pytest.mark.mcore]\n", True),
        ("pytestmark: list = (pytest.mark.mcore,)\n", True),
        ("pytestmark = pytest.mark.cuda\n", False),
        ("marks = pytest.mark.mcore\n", False),
        ("def f():\n    pytestmark = pytest.mark.mcore\n", False),
        ("pytestmark = other.mark.mcore\n", False),
        ('"""pytestmark = pytest.mark.mcore"""\n', False),
    ],
)
def test_a_file_is_marked_by_its_module_level_pytestmark(source, want):
    assert _matrix_tests().is_marked(source) is want


def test_the_matrix_lists_the_marked_files_and_refuses_none(tmp_path, capsys):
    script = _matrix_tests()
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_a.py").write_text("import pytest\npytestmark = pytest.mark.mcore\n")
    (tmp_path / "tests" / "test_b.py").write_text("def test_b():\n    pass\n")
    (tmp_path / "tests" / "helper.py").write_text("pytestmark = pytest.mark.mcore\n")
    assert script.main([str(tmp_path)]) == 0
    assert capsys.readouterr().out == "tests/test_a.py\n"
    # the torch-only install's list: the rest of the test files, never a helper
    assert script.main(["--unmarked", str(tmp_path)]) == 0
    assert capsys.readouterr().out == "tests/test_b.py\n"
    (tmp_path / "tests" / "test_a.py").write_text("def test_a():\n    pass\n")
    assert script.main([str(tmp_path)]) == 1
    assert "no test file" in capsys.readouterr().err
    (tmp_path / "tests" / "test_a.py").write_text("import pytest\npytestmark = pytest.mark.mcore\n")
    (tmp_path / "tests" / "test_b.py").write_text("import pytest\npytestmark = pytest.mark.mcore\n")
    assert script.main(["--unmarked", str(tmp_path)]) == 1
    assert "is unmarked" in capsys.readouterr().err
