"""The packaging config covers every folder it ships, so an install prints no setuptools
warning of ours ("Package 'trainwire.data' is absent from the packages configuration")."""

from __future__ import annotations

import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - the test extra installs tomli there
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent


def shipped_folders(package: str, folder: Path) -> set[str]:
    """Every folder under ``folder`` that holds a file setuptools would ship or warn about."""
    found = set()
    for path in folder.rglob("*"):
        if path.is_file() and "__pycache__" not in path.parts:
            relative = path.parent.relative_to(folder)
            found.add(".".join([package, *relative.parts]))
    return found


def test_every_shipped_folder_is_a_listed_package() -> None:
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages = set(setuptools["packages"])
    for package, folder in setuptools["package-dir"].items():
        # A mapped sub-package's own folder is checked under its own mapping.
        nested = {p for p in setuptools["package-dir"] if p.startswith(package + ".")}
        folders = {
            name
            for name in shipped_folders(package, ROOT / folder)
            if not any(name == n or name.startswith(n + ".") for n in nested)
        }
        assert folders <= packages, f"not in [tool.setuptools] packages: {folders - packages}"


def test_the_corpus_ships_as_package_data() -> None:
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert setuptools["package-data"]["trainwire.data"] == ["*.txt"]
    assert (ROOT / "trainwire" / "data" / "corpus.txt").is_file()
