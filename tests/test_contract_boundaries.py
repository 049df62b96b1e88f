"""The contract is the only thing the two sides share: the server imports the contract, never the
client; the contract imports neither side, nor torch. Calls go one way, transport -> service ->
engine: no transport (gRPC, Tinker) imports an engine module. Checked on the source tree's imports
(every ``import`` statement, at any depth, relative ones resolved, and every
``importlib.import_module`` of a literal name), so a lazy import inside a function counts too."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import trainwire.client
from trainwire.client.session import errors, session_client
from trainwire.contract import config, outcomes, tokens
from trainwire.contract.planning import manifest, overrides, plan

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("torch", "numpy", "transformers")
ENGINE = "trainwire.server.engine"
TRANSPORTS = ("grpc", "tinker")  # the folders under server/ that a client's request enters by
# The import package each source folder is (pyproject's package-dir mapping).
PACKAGE_OF_FOLDER = {"server": "trainwire.server", "client": "trainwire.client"}
TINKER_PACKAGE = "trainwire.server.tinker"


def package_of(path: Path) -> str:
    """The dotted package a source file under ``ROOT`` belongs to (``server/tinker/app.py``:
    ``trainwire.server.tinker``), which its relative imports start from."""
    top, *folders = path.resolve().relative_to(ROOT).parent.parts
    return ".".join([PACKAGE_OF_FOLDER.get(top, top), *folders])


def absolute_module(package: str, level: int, module: str | None) -> str:
    """The module a ``from`` import names: ``module`` itself when absolute (``level`` 0), else
    counted up from ``package`` (level 1 is ``package``, 2 its parent, ...)."""
    if level == 0:
        return module or ""
    parts = package.split(".")
    base = parts[: len(parts) - level + 1]
    return ".".join([*base, module] if module else base)


def imported_names(path: Path, package: str | None = None) -> list[tuple[int, str]]:
    """(line, dotted name) of everything ``path`` imports: modules, and ``from`` imports as
    ``module.name`` (so ``from trainwire import client`` reads ``trainwire.client``), relative
    ones resolved from ``package`` (by default the file's own, ``package_of``)."""
    package = package if package is not None else package_of(path)
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = absolute_module(package, node.level, node.module)
            found += [(node.lineno, f"{module}.{alias.name}") for alias in node.names]
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.append((node.lineno, node.args[0].value))
    return found


def imports_under(folder: Path, forbidden: tuple[str, ...]) -> list[str]:
    """``file:line name`` for every import of a forbidden package (or a module inside it)."""
    sources = sorted(folder.rglob("*.py"))
    assert sources, f"no Python files under {folder}"
    return [
        f"{path.relative_to(ROOT)}:{line} {name}"
        for path in sources
        for line, name in imported_names(path)
        if any(name == package or name.startswith(package + ".") for package in forbidden)
    ]


def test_no_server_module_imports_the_client():
    assert imports_under(ROOT / "server", ("trainwire.client",)) == []


def test_no_transport_module_imports_the_engine():
    """The gRPC servicer and the Tinker front reach the engine through the service only (the
    Tinker front's losses and LoRA roles: ``service/capabilities.py``)."""
    for transport in TRANSPORTS:
        assert imports_under(ROOT / "server" / transport, (ENGINE,)) == [], transport


def test_the_import_check_sees_every_way_of_naming_the_engine(tmp_path):
    """Each form an import of the engine can take is read as the engine (the file is read as a
    module of the Tinker front, so its relative imports resolve from
    ``trainwire.server.tinker``)."""
    forms = [
        "import trainwire.server.engine.loss.losses",
        "from trainwire.server.engine.loss.losses import LOSSES",
        "from trainwire.server import engine",
        "from ..engine.weights import module_roles",
        "from .. import engine",
        "def lazy():\n    from trainwire.server.engine.weights.module_roles import ROLES",
        "importlib.import_module('trainwire.server.engine.session.session')",
    ]
    probe = tmp_path / "probe.py"
    for form in forms:
        probe.write_text(form + "\n", encoding="utf-8")
        found = [name for _, name in imported_names(probe, TINKER_PACKAGE)]
        assert any(name.startswith(ENGINE) for name in found), (form, found)
    probe.write_text("from .front import TinkerFront\n", encoding="utf-8")
    assert [name for _, name in imported_names(probe, TINKER_PACKAGE)] == [
        "trainwire.server.tinker.front.TinkerFront"
    ]
    assert package_of(ROOT / "server" / "tinker" / "app.py") == TINKER_PACKAGE


def test_the_contract_imports_neither_side_nor_torch():
    forbidden = ("trainwire.client", "trainwire.server", *HEAVY)
    assert imports_under(ROOT / "trainwire" / "contract", forbidden) == []


def test_a_fresh_python_imports_every_contract_module_without_torch():
    modules = [
        ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for path in sorted((ROOT / "trainwire" / "contract").rglob("*.py"))
    ]
    assert "trainwire.contract.codec" in modules
    script = (
        "import importlib, sys\n"
        f"for name in {modules!r}: importlib.import_module(name)\n"
        f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r})))"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_the_client_exports_the_contract_types_themselves():
    """``from trainwire.client import X`` keeps working, and gives the contract's own X, so a
    config built on either side is the same class."""
    defined_in = {
        config: ("InputExample", "LoraSettings", "TrainingConfig"),
        tokens: ("TokenExample",),
        outcomes: ("Sample",),
        plan: ("MANIFEST_FORMAT", "ManagedTrainingPlan", "Microbatch"),
        manifest: (
            "load_plan",
            "read_config_file",
            "read_examples_jsonl",
            "read_manifest",
            "write_manifest",
            "write_plan_manifest",
        ),
        overrides: ("parse_config_overrides",),
        session_client: ("SessionClient",),
        errors: ("ServerUnreachable", "SessionError"),
    }
    for module, names in defined_in.items():
        for name in names:
            assert getattr(trainwire.client, name) is getattr(module, name), name
    listed = {name for names in defined_in.values() for name in names}
    assert set(trainwire.client.__all__) == listed | {"forward_backward_custom", "Controller"}
    # The controller is the client's own (the design card names it under trainwire.client).
    from trainwire.client.control.controller import Controller

    assert trainwire.client.Controller is Controller
