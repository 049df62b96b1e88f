"""The Tinker SDK front in the image and on Kubernetes: the worker serves it on a port of its own
beside gRPC, keyed by the tenants map from the Secret trainwire-tenants, published by the headless
Service and admitted by the network policy for the SDK's clients only; the image installs the
front's extra and exposes its port; components/lab makes one pod that holds N runs.

The last test starts a real ``trainwire serve`` with the worker container's own arguments, as
rendered, with the example Secrets mounted: only the volumes' paths (a temporary directory), the
device (the CPU for ``cuda``) and the port numbers (free ones) differ. Each researcher of the
example map points the real Tinker SDK at it with their key.
"""

from __future__ import annotations

import ast
import contextlib
import re
import shlex
import signal
import subprocess
import sys
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

import grpc
import httpx
import pytest
import tinker
import yaml
from deploy_files import (
    DEPLOY,
    PORT,
    ROOT,
    STATEFULSET,
    TINKER_PORT,
    container_ports,
    load_documents,
    only,
    parse_serve,
    secret_file,
    stages,
)
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kustomize_render import PatchTestFailed, json_patch, rendered_statefulset
from packaging.requirements import Requirement
from tinker_loops import close_quietly

from trainwire.server.service.tenants import Tenants
from trainwire.testing import free_port, wait_for_listener

TINKER_EXTRA = "tinker"
SERVE_START_TIMEOUT_S = 120


def pod_and_container(statefulset: dict) -> tuple[dict, dict]:
    pod = statefulset["spec"]["template"]["spec"]
    (running,) = pod["containers"]
    return pod, running


def test_the_worker_serves_the_tinker_front_beside_grpc_on_the_exposed_port(container, runtime):
    settings = parse_serve(container["args"])
    assert settings.tinker_listen == f"0.0.0.0:{TINKER_PORT}"
    assert container_ports(container) == {"grpc": PORT, "tinker": TINKER_PORT}
    assert only(runtime, "EXPOSE").split() == [str(PORT), str(TINKER_PORT)]
    # The dispatcher keeps its token on the gRPC port; the researchers' keys are the front's.
    assert settings.token_file and settings.tinker_token_file and settings.tenants is None
    assert Path(settings.token_file).parent != Path(settings.tinker_token_file).parent


def test_the_tenants_map_comes_from_a_secret_file(statefulset, container, example_secrets):
    pod, _ = pod_and_container(statefulset)
    tenants_file = Path(parse_serve(container["args"]).tinker_token_file)
    _, secret = secret_file(pod, container, str(tenants_file))
    (item,) = secret["items"]
    assert item["path"] == tenants_file.name
    assert secret["defaultMode"] & 0o007 == 0, "the keys are not world-readable"
    # The example Secret has that name and key, and its map is one `trainwire serve` takes.
    example = example_secrets[secret["secretName"]]
    assert example["type"] == "Opaque"
    keys = [
        tenant["key"] for tenant in yaml.safe_load(example["stringData"][item["key"]])["tenants"]
    ]
    assert len(keys) >= 2 and all(key.startswith("tml-") for key in keys)  # the SDK's rule


def test_the_example_tenants_map_loads_as_the_server_reads_it(example_secrets, tmp_path):
    tenants_file = tmp_path / "tenants.yaml"
    tenants_file.write_text(example_secrets["trainwire-tenants"]["stringData"]["tenants.yaml"])
    tenants = Tenants.load(tenants_file)
    assert [tenant.name for tenant in tenants] == ["alice", "bob"]


def test_the_lab_component_makes_one_pod_that_holds_several_runs(statefulset):
    lab = rendered_statefulset("lab")
    assert lab["spec"]["replicas"] == 1
    _, base = pod_and_container(rendered_statefulset())
    _, running = pod_and_container(lab)
    assert parse_serve(base["args"]).max_runs == 1
    assert parse_serve(running["args"]).max_runs == 8
    # Nothing else changes: the same arguments but the number of runs.
    value = running["args"].index("--max-runs") + 1
    assert running["args"][:value] == base["args"][:value]
    assert running["args"][value + 1 :] == base["args"][value + 1 :]


def test_the_lab_component_refuses_to_patch_arguments_that_moved(statefulset):
    """Its patch replaces an argument by position; a `test` first checks the position still
    holds --max-runs, so reordered arguments fail the build instead of changing another one."""
    operations = yaml.safe_load((DEPLOY / "components/lab/statefulset-patch.yaml").read_text())
    moved = json_patch(statefulset, [])
    _, running = pod_and_container(moved)
    running["args"] = running["args"][2:] + running["args"][:2]  # --listen last
    with pytest.raises(PatchTestFailed, match=re.escape("is '--listen', not '--max-runs'")):
        json_patch(moved, operations)


def builder_commands(dockerfile: list[tuple[str, str]]) -> list[list[str]]:
    """The builder stage's shell commands, each split as the shell splits it."""
    commands: list[list[str]] = []
    for keyword, arguments in stages(dockerfile)[0]:
        if keyword == "RUN":
            for command in arguments.split("&&"):
                commands.append(shlex.split(command))
    return commands


def test_the_image_installs_the_built_wheel_with_the_tinker_extra(dockerfile):
    commands = builder_commands(dockerfile)
    (build,) = [c for c in commands if c[:2] == ["pip", "wheel"]]
    (install,) = [c for c in commands if c[:2] == ["pip", "install"] and "torch" not in str(c)]
    wheel_dir = build[build.index("--wheel-dir") + 1]
    # The wheel just built (one: a fresh directory), with the front's extra.
    assert install[2:] == ["--no-cache-dir", f"$(echo {wheel_dir}/trainwire-*.whl)[{TINKER_EXTRA}]"]
    assert TINKER_EXTRA in (metadata.metadata("trainwire").get_all("Provides-Extra") or [])


def imported_top_level_modules(folder: Path) -> set[str]:
    modules = set()
    for path in folder.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                modules.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules.add(node.module.split(".")[0])
    return modules - set(sys.stdlib_module_names) - {"trainwire", "__future__"}


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def installed_with(distribution: str, extra: str) -> set[str]:
    """The distributions ``pip install 'distribution[extra]'`` installs: its requirements, the
    extra's, and theirs in turn (as installed here)."""
    found: set[str] = set()
    pending = [(distribution, extra)]
    while pending:
        name, wanted = pending.pop()
        for line in metadata.requires(name) or []:
            requirement = Requirement(line)
            marker = requirement.marker
            if marker is not None and not marker.evaluate({"extra": wanted}):
                continue
            if normalized(requirement.name) not in found:
                found.add(normalized(requirement.name))
                pending.append((requirement.name, ""))
    return found


def test_the_tinker_extra_holds_every_package_the_front_imports():
    """The image has the core dependencies and the extra, nothing else: every third-party module
    server/tinker/ imports must come from one of them, or the front fails in the image only."""
    installed = installed_with("trainwire", TINKER_EXTRA)
    assert "trainwire" not in installed and {"tinker", "fastapi", "uvicorn"} <= installed
    providers = metadata.packages_distributions()
    for module in sorted(imported_top_level_modules(ROOT / "server" / "tinker")):
        names = {normalized(name) for name in providers.get(module, [])}
        assert names & installed, f"server/tinker imports {module}, which the image lacks"


# ---- a real server with the container's own arguments ----------------------------------------


def mounted_paths(pod: dict, running: dict, tmp_path: Path, model_root: Path) -> dict[str, Path]:
    """Each mount path of the container, as a directory here: the example Secrets written into
    theirs as the kubelet projects them, the models volume the tiny models' root."""
    secrets = {
        document["metadata"]["name"]: document
        for path in sorted((DEPLOY / "examples").glob("*.example.yaml"))
        for document in load_documents(path)
    }
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    paths = {}
    for mount in running["volumeMounts"]:
        volume = volumes.get(mount["name"], {})
        if "persistentVolumeClaim" in volume and mount.get("readOnly"):
            paths[mount["mountPath"]] = model_root
            continue
        directory = tmp_path / mount["name"]
        directory.mkdir()
        if "secret" in volume:
            data = secrets[volume["secret"]["secretName"]]["stringData"]
            for item in volume["secret"]["items"]:
                (directory / item["path"]).write_text(data[item["key"]])
        paths[mount["mountPath"]] = directory
    return paths


def local_arguments(
    arguments: list[str], paths: dict[str, Path], ports: dict[int, int]
) -> list[str]:
    """The container's arguments with its paths, device and ports made local."""
    local = []
    for argument in arguments:
        for mount_path, directory in paths.items():
            if argument == mount_path or argument.startswith(mount_path + "/"):
                argument = str(directory) + argument[len(mount_path) :]
                break
        host, _, port = argument.rpartition(":")
        if host == "0.0.0.0" and int(port) in ports:
            argument = f"{host}:{ports[int(port)]}"
        local.append("cpu" if argument == "cuda" else argument)
    return local


@contextlib.contextmanager
def serving(arguments: list[str], log: Path, ports: dict[int, int]) -> Iterator[None]:
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "trainwire", "serve", *arguments], stdout=out, stderr=out
        )
    try:
        for port in ports.values():
            try:
                wait_for_listener(f"127.0.0.1:{port}", timeout_s=SERVE_START_TIMEOUT_S)
            except TimeoutError:
                raise AssertionError(log.read_text(errors="replace")[-3000:]) from None
        yield
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=90) == 0, log.read_text(errors="replace")[-3000:]


def grpc_health(port: int) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        return (
            health_pb2_grpc.HealthStub(channel)
            .Check(health_pb2.HealthCheckRequest(), timeout=30)
            .status
        )


@pytest.mark.slow  # a real server and SDK clients: 20-50 s on two busy cores
@pytest.mark.parametrize("components", [(), ("lab",)], ids=["base", "lab"])
def test_the_rendered_worker_arguments_serve_both_ports_to_the_example_tenants(
    components, tmp_path, model_root, tiny_llama
):
    statefulset = rendered_statefulset(*components)
    assert (statefulset["kind"], statefulset["metadata"]["name"]) == STATEFULSET
    pod, running = pod_and_container(statefulset)
    ports = {PORT: free_port(), TINKER_PORT: free_port()}
    paths = mounted_paths(pod, running, tmp_path, model_root)
    arguments = local_arguments(running["args"], paths, ports)
    settings = parse_serve(arguments)
    tenants = {t.name: t.key for t in Tenants.load(Path(settings.tinker_token_file))}
    token = Path(settings.token_file).read_text()
    base_url = f"http://127.0.0.1:{ports[TINKER_PORT]}"
    healthz = f"{base_url}/api/v1/healthz"
    with serving(arguments, tmp_path / "serve.log", ports):
        assert grpc_health(ports[PORT]) == health_pb2.HealthCheckResponse.SERVING
        for key in tenants.values():
            assert httpx.get(healthz, headers={"X-API-Key": key}).status_code == 200
        # The front takes the map's keys only: not the gRPC token, not a key of nobody's.
        for key in (token, "tml-nobody"):
            assert httpx.get(healthz, headers={"X-API-Key": key}).status_code == 401
        # Each researcher points the SDK at the pod with their own key and opens a LoRA run,
        # which only they see; with the lab's N runs, both runs are open side by side on the one
        # base model (the base pod holds one run).
        clients = {
            name: tinker.ServiceClient(base_url=base_url, api_key=key)
            for name, key in tenants.items()
        }
        try:
            side_by_side = settings.max_runs >= len(tenants)
            assert side_by_side == ("lab" in components)
            researchers = list(tenants) if side_by_side else list(tenants)[:1]
            for name in researchers:
                clients[name].create_lora_training_client(
                    base_model=tiny_llama.name, rank=4
                ).result()
            for name in researchers:
                rest = tinker.RestClient(base_url=base_url, api_key=tenants[name])
                runs = rest.list_training_runs().result().training_runs
                assert len(runs) == 1, f"{name} sees {len(runs)} runs"
        finally:
            for client in clients.values():
                close_quietly(client)
