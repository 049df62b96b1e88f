"""What the Dockerfile and deploy/ tests share: the files, the worker's fixed facts, and readers.

- The Dockerfile as (INSTRUCTION, arguments) pairs and its stages (:func:`dockerfile_instructions`,
  :func:`stages`, :func:`only`, :func:`exec_form`, :func:`env_values`).
- `trainwire serve`'s real parser (:func:`parse_serve`), so the image and the manifests are checked
  against the command line they run.
- :func:`serving_health`: a real gRPC health server on loopback, for the probes to ask.
- The manifests: :func:`load_documents`, :func:`deploy_kustomization`, :func:`resource_objects`,
  :func:`example_documents`. The kustomization rendered as `kubectl kustomize` renders it is in
  kustomize.py; the fixtures over all this are in conftest.py.
- One session on several GPUs: deploy/multi-pod's LeaderWorkerSet (:func:`pod_templates`,
  :func:`state_claim`) and its pods' command lines as they run (:func:`pod_command`, with the
  variables LeaderWorkerSet sets, read by :func:`torchrun_parser` and :func:`serve_settings`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import yaml
from grpc_health.v1 import health, health_pb2_grpc

from trainwire.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
TLS_PROBE = DEPLOY / "components" / "tls" / "tls_probe.py"

PORT = 50051
TINKER_PORT = 8000  # the Tinker SDK front (--tinker-listen)
WORKER_SELECTOR = {"app.kubernetes.io/name": "trainwire", "app.kubernetes.io/component": "worker"}
DISPATCHER_LABELS = {"app.kubernetes.io/component": "dispatcher"}
TINKER_CLIENT_LABELS = {"app.kubernetes.io/component": "tinker-client"}
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


# ---- `trainwire serve`'s command line ----------------------------------------------------------


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


def container_ports(running: dict) -> dict[str, int]:
    """A container's ports by name."""
    return {port["name"]: port["containerPort"] for port in running["ports"]}


def secret_file(pod: dict, running: dict, path: str) -> tuple[dict, dict]:
    """The read-only mount that holds ``path`` in ``running`` and its Secret volume's source."""
    directory = str(Path(path).parent)
    (mount,) = [m for m in running["volumeMounts"] if m["mountPath"] == directory]
    assert mount["readOnly"] is True, f"{directory} is writable"
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    return mount, volumes[mount["name"]]["secret"]


@contextlib.contextmanager
def serving_health(
    credentials: grpc.ServerCredentials | None = None,
) -> Iterator[tuple[health.HealthServicer, int]]:
    """A gRPC health server on a free loopback port (TLS with ``credentials``): (servicer, port)."""
    servicer = health.HealthServicer()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    address = "127.0.0.1:0"
    port = (
        server.add_secure_port(address, credentials)
        if credentials is not None
        else server.add_insecure_port(address)
    )
    server.start()
    try:
        yield servicer, port
    finally:
        server.stop(None)


# ---- the manifests ----------------------------------------------------------------------------


def load_documents(path: Path) -> list[dict]:
    return [document for document in yaml.safe_load_all(path.read_text()) if document]


def deploy_kustomization() -> dict:
    """deploy/kustomization.yaml as written (components commented out)."""
    return yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())


def resource_objects(kustomization: dict) -> dict[tuple[str, str], dict]:
    """The kustomization's resources by (kind, name); a name defined twice fails."""
    found = {}
    for resource in kustomization["resources"]:
        for document in load_documents(DEPLOY / resource):
            key = (document["kind"], document["metadata"]["name"])
            assert key not in found, f"{key} is defined twice"
            found[key] = document
    return found


def example_documents() -> dict[str, dict]:
    """deploy/examples/*.example.yaml (the example Secrets) by name."""
    return {
        document["metadata"]["name"]: document
        for path in sorted((DEPLOY / "examples").glob("*.example.yaml"))
        for document in load_documents(path)
    }


def manifest_files(directory: Path) -> set[str]:
    return {p.name for p in directory.glob("*.y*ml")} - {"kustomization.yaml"}


# ---- one session on several pods: deploy/multi-pod --------------------------------------------

MULTI_POD = DEPLOY / "multi-pod"
LEADER_WORKER_SET = ("LeaderWorkerSet", "trainwire-sharded")
LEADER_SERVICE = ("Service", "trainwire-sharded-leader")
STATE_CLAIM_FILE = "state-pvc.yaml"
SHARDED_SELECTOR = {
    "app.kubernetes.io/name": "trainwire",
    "app.kubernetes.io/component": "sharded-worker",
}
# What LeaderWorkerSet sets on its pods (sigs.k8s.io/lws, api/leaderworkerset/v1, v0.6 and newer).
LWS_NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"
LWS_WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"
TORCHRUN_MASTER_PORT = 29500


def multi_pod_kustomization() -> dict:
    return yaml.safe_load((MULTI_POD / "kustomization.yaml").read_text())


def pod_templates(leader_worker_set: dict) -> list[dict]:
    """The leader's pod template, then the workers'."""
    template = leader_worker_set["spec"]["leaderWorkerTemplate"]
    return [template["leaderTemplate"], template["workerTemplate"]]


def only_container(template: dict) -> dict:
    """A pod template's one container."""
    (found,) = template["spec"]["containers"]
    return found


def serve_settings(running: dict) -> argparse.Namespace:
    """What `trainwire serve` reads from a torchrun container's arguments (those after serve)."""
    arguments = running["args"]
    return parse_serve(arguments[arguments.index("serve") + 1 :])


def state_claim() -> dict:
    (claim,) = load_documents(MULTI_POD / STATE_CLAIM_FILE)
    return claim


def option(arguments: list[str], flag: str) -> str:
    (index,) = [i for i, argument in enumerate(arguments) if argument == flag]
    return arguments[index + 1]


# ---- several pods: torchrun -------------------------------------------------------------------


def torchrun_parser() -> argparse.ArgumentParser:
    """torchrun's flags that the manifests use, spelled as torch.distributed.run spells them."""
    parser = argparse.ArgumentParser(prog="torchrun", allow_abbrev=False)
    parser.add_argument("--nnodes", required=True)
    parser.add_argument("--nproc-per-node", "--nproc_per_node", required=True)
    parser.add_argument("--node-rank", "--node_rank", type=int, required=True)
    parser.add_argument("--master-addr", "--master_addr", required=True)
    parser.add_argument("--master-port", "--master_port", type=int, required=True)
    parser.add_argument("--max-restarts", "--max_restarts", type=int, required=True)
    parser.add_argument("-m", "--module", action="store_true")
    parser.add_argument("training_script")
    parser.add_argument("training_script_args", nargs=argparse.REMAINDER)
    return parser


def lws_environment(leader_worker_set: dict, worker_index: int) -> dict[str, str]:
    """What LeaderWorkerSet's pod webhook adds to every container of pod ``worker_index``.

    Group 0 under the Shared subdomain policy: the leader's address is
    ``<name>-<group>.<name>.<namespace>`` (LeaderWorkerSet's own headless Service).
    """
    name = leader_worker_set["metadata"]["name"]
    namespace = leader_worker_set["metadata"].get("namespace", "trainwire")
    return {
        "LWS_LEADER_ADDRESS": f"{name}-0.{name}.{namespace}",
        "LWS_GROUP_SIZE": str(leader_worker_set["spec"]["leaderWorkerTemplate"]["size"]),
        "LWS_WORKER_INDEX": str(worker_index),
    }


def expand(argument: str, environment: dict[str, str]) -> str:
    """The kubelet's $(VAR) expansion of a container argument ($$ escapes; unknown stays)."""
    return re.sub(
        r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
        lambda m: "$" if m.group(0) == "$$" else environment.get(m.group(1), m.group(0)),
        argument,
    )


def pod_command(leader_worker_set: dict, worker_index: int) -> list[str]:
    """Pod ``worker_index``'s command line (command, then args) as its container runs it."""
    templates = pod_templates(leader_worker_set)
    running = only_container(templates[0] if worker_index == 0 else templates[1])
    environment = lws_environment(leader_worker_set, worker_index)
    return [expand(a, environment) for a in running["command"] + running["args"]]


# -- shared by the one-pod and multi-pod tests --------------------------------------------------


def gpus(running: dict) -> int:
    resources = running["resources"]
    limit = int(resources["limits"]["nvidia.com/gpu"])
    assert int(resources["requests"].get("nvidia.com/gpu", limit)) == limit
    return limit


def gibibytes(quantity: str) -> float:
    units = {"Gi": 1, "Ti": 1024, "Mi": 1 / 1024}
    number, unit = re.fullmatch(r"(\d+)(Gi|Ti|Mi)", quantity).groups()
    return int(number) * units[unit]


# CI installs kubectl (.ci/run): there a missing one fails the check instead of skipping it.
needs_kubectl = pytest.mark.skipif(
    shutil.which("kubectl") is None and not os.environ.get("CI"),
    reason="kubectl is not installed (CI installs it and runs this check)",
)


def kubectl_kustomize(folder: Path, components: list[str], tmp_path: Path) -> list[dict]:
    """`kubectl kustomize` of a copy of deploy/ with ``components`` enabled in ``folder``'s."""
    copy = tmp_path / "deploy"
    shutil.copytree(DEPLOY, copy)
    target = copy / folder.relative_to(DEPLOY)
    kustomization = yaml.safe_load((target / "kustomization.yaml").read_text())
    kustomization["components"] = components
    (target / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    output = subprocess.run(
        ["kubectl", "kustomize", str(target)], capture_output=True, text=True, check=False
    )
    assert output.returncode == 0, output.stderr
    return [d for d in yaml.safe_load_all(output.stdout) if d]


def by_kind_and_name(documents: list[dict]) -> dict[tuple[str, str], dict]:
    return {(d["kind"], d["metadata"]["name"]): d for d in documents}
