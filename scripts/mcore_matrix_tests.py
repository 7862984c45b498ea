"""Print the test files the megatron-core version matrix runs, one per line.

Usage: python scripts/mcore_matrix_tests.py [--unmarked] [ROOT]

Every ``tests/test_*.py`` of ROOT (default: this repository) whose module-level
``pytestmark`` carries ``pytest.mark.mcore``: the files that touch megatron-core, directly or
through the test support, the benchmarks or another test module they import.
``tests/test_mcore_marker.py`` checks that exactly those files carry it, so the list cannot
drift from what the files import. With ``--unmarked``, the other test files: those that touch
nothing of megatron-core, which the torch-only install runs (``scripts/torch_only.sh``).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

MARKER = "mcore"


def _marks(node: ast.expr) -> list[ast.expr]:
    return list(node.elts) if isinstance(node, ast.List | ast.Tuple) else [node]


def is_marked(source: str) -> bool:
    """Whether ``source`` assigns ``pytestmark`` at module level with ``pytest.mark.mcore``
    (alone or in a list or tuple of marks)."""
    for stmt in ast.parse(source).body:
        if isinstance(stmt, ast.Assign):
            targets, value = stmt.targets, stmt.value
        elif isinstance(stmt, ast.AnnAssign) and stmt.value is not None:
            targets, value = [stmt.target], stmt.value
        else:
            continue
        if not any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in targets):
            continue
        for mark in _marks(value):
            if (
                isinstance(mark, ast.Attribute)
                and mark.attr == MARKER
                and isinstance(mark.value, ast.Attribute)
                and mark.value.attr == "mark"
                and isinstance(mark.value.value, ast.Name)
                and mark.value.value.id == "pytest"
            ):
                return True
    return False


def marked_files(root: Path) -> list[str]:
    """The marked ``tests/test_*.py`` of ``root``, relative to it, sorted."""
    return sorted(
        str(path.relative_to(root))
        for path in (root / "tests").glob("test_*.py")
        if is_marked(path.read_text())
    )


def unmarked_files(root: Path) -> list[str]:
    """The other ``tests/test_*.py`` of ``root``, relative to it, sorted."""
    marked = set(marked_files(root))
    every = (str(p.relative_to(root)) for p in (root / "tests").glob("test_*.py"))
    return sorted(set(every) - marked)


def main(argv: list[str]) -> int:
    unmarked = "--unmarked" in argv
    argv = [a for a in argv if a != "--unmarked"]
    root = Path(argv[0]) if argv else Path(__file__).resolve().parents[1]
    files = unmarked_files(root) if unmarked else marked_files(root)
    if not files:
        which = "unmarked" if unmarked else f"marked {MARKER}"
        print(f"error: no test file under {root / 'tests'} is {which}", file=sys.stderr)
        return 1
    print("\n".join(files))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
