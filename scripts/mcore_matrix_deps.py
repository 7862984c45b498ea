"""Print the requirements of a megatron-core install that the running venv does not satisfy.

Usage: python scripts/mcore_matrix_deps.py FOLDER

FOLDER is a version's folder from scripts/mcore_matrix.sh: either a ``pip --target`` install
(its ``megatron_core-*.dist-info/METADATA`` lists ``Requires-Dist``) or a Megatron-LM source
extract (its ``pyproject.toml`` lists ``[project] dependencies``). Requirements behind an
extra are ignored. One unsatisfied requirement per line; nothing when all are met. Packages
already inside FOLDER (installed there earlier) count as satisfying.
"""

from __future__ import annotations

import sys
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement


def requirements(folder: Path) -> list[Requirement]:
    infos = sorted(folder.glob("megatron_core-*.dist-info/METADATA"))
    if infos:
        text = metadata.Distribution.at(infos[0].parent).requires or []
    else:
        pyproject = folder / "pyproject.toml"
        if not pyproject.exists():
            raise SystemExit(f"{folder}: neither a megatron_core dist-info nor a pyproject.toml")
        text = tomllib.loads(pyproject.read_text())["project"].get("dependencies", [])
    reqs = [Requirement(r) for r in text]
    return [r for r in reqs if r.marker is None or r.marker.evaluate({"extra": ""})]


def installed(name: str, folder: Path) -> str | None:
    for dist in metadata.distributions(path=[str(folder), *sys.path]):
        if dist.metadata["Name"] and _norm(dist.metadata["Name"]) == _norm(name):
            return dist.version
    return None


def _norm(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def main() -> None:
    folder = Path(sys.argv[1])
    for req in requirements(folder):
        if _norm(req.name) == "megatron-core":
            continue
        version = installed(req.name, folder)
        if version is None or not req.specifier.contains(version, prereleases=True):
            print(str(req))


if __name__ == "__main__":
    main()
