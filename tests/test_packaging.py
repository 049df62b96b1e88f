"""The packaging config covers every folder it ships, so an install prints no setuptools
warning of ours ("Package 'trainwire.data' is absent from the packages configuration"), and
both installs build from the layout without setuptools' boxed warning about an import hook."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - the test extra installs tomli there
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
BUILD_INPUTS = ("pyproject.toml", "README.md", "src", "trainwire", "client", "server")


def setuptools_config() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def shipped_folders(package: str, folder: Path) -> set[str]:
    """Every folder under ``folder`` that holds a file setuptools would ship or warn about
    (links followed, as setuptools follows them)."""
    found = set()
    for directory, dirs, files in os.walk(folder, followlinks=True):
        dirs[:] = [d for d in dirs if d != "__pycache__" and not d.endswith(".egg-info")]
        if files:
            relative = Path(directory).relative_to(folder)
            found.add(".".join(part for part in (package, *relative.parts) if part))
    return found


def test_every_shipped_folder_is_a_listed_package() -> None:
    setuptools = setuptools_config()
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
    setuptools = setuptools_config()
    assert setuptools["package-data"]["trainwire.data"] == ["*.txt"]
    assert (ROOT / "trainwire" / "data" / "corpus.txt").is_file()


def scratch_project(tmp_path: Path) -> Path:
    """What a build reads (what the Dockerfile copies), links kept as links."""
    project = tmp_path / "project"
    project.mkdir()
    for name in BUILD_INPUTS:
        source = ROOT / name
        if source.is_dir() and not source.is_symlink():
            ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
            shutil.copytree(source, project / name, symlinks=True, ignore=ignore)
        elif source.exists():
            shutil.copy2(source, project / name, follow_symlinks=False)
    return project


def build(project: Path, hook: str) -> tuple[zipfile.ZipFile, str]:
    """Run one PEP 517/660 hook as pip runs it (offline, in the project): the wheel and the
    build's whole output, warnings shown."""
    out = project.parent / hook
    code = "import sys; from setuptools import build_meta as b\n"
    code += "print(getattr(b, sys.argv[1])(sys.argv[2]))"
    done = subprocess.run(
        [sys.executable, "-W", "always", "-c", code, hook, str(out)],
        cwd=project,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    wheel = zipfile.ZipFile(out / done.stdout.strip().splitlines()[-1])
    return wheel, done.stdout + done.stderr


def test_both_installs_build_without_a_warning_and_put_only_the_package_on_sys_path(tmp_path):
    project = scratch_project(tmp_path)
    editable, editable_log = build(project, "build_editable")
    wheel, wheel_log = build(project, "build_wheel")
    for log in (editable_log, wheel_log):
        assert "Please be careful" not in log
        assert not re.findall(r"\w+Warning: .*", log)
    # The editable install is one .pth line naming src/, which holds only the package: no import
    # hook (the meta path finder setuptools warns about), and never the checkout's root.
    pth = [name for name in editable.namelist() if not name.startswith("trainwire-0.1.0.dist-info")]
    assert pth == ["__editable__.trainwire-0.1.0.pth"]
    assert editable.read(pth[0]).decode().split() == [str((project / "src").resolve())]
    assert [p.name for p in (project / "src").iterdir() if p.suffix != ".egg-info"] == ["trainwire"]
    # The wheel holds every listed package under trainwire/, and nothing else at its top.
    names = wheel.namelist()
    assert {name.split("/")[0] for name in names} == {"trainwire", "trainwire-0.1.0.dist-info"}
    for package in setuptools_config()["packages"]:
        assert any(name.startswith(package.replace(".", "/") + "/") for name in names), package
