"""The worker's Kubernetes manifests (deploy/), without a cluster: each validated offline against
the Kubernetes schemas (kubernetes-validate), raw and rendered, and cross-checked against each
other, the Dockerfile and the real `trainwire serve` command line.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from deploy_files import (
    DEPLOY,
    DISPATCHER_LABELS,
    PORT,
    STATEFULSET,
    TINKER_CLIENT_LABELS,
    TINKER_PORT,
    WORKER_SELECTOR,
    container_ports,
    deploy_kustomization,
    exec_form,
    listen_port,
    load_documents,
    manifest_files,
    only,
    parse_serve,
)
from kustomize_render import rendered

# The oldest Kubernetes the manifests are meant for (StatefulSet PVC retention is GA in 1.32), and
# the newest whose schemas kubernetes-validate ships.
OLDEST_KUBERNETES = "1.32"


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


@pytest.mark.parametrize("component", ["tls", "tls-client-auth", "lab"])
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


def validated_documents() -> list[tuple[str, dict]]:
    kustomization = deploy_kustomization()
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
    for components in ((), ("tls",), ("tls", "tls-client-auth"), ("lab",)):
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


def test_the_headless_service_names_every_worker_on_the_grpc_and_tinker_ports(
    deploy_objects, statefulset, container
):
    service = deploy_objects[("Service", statefulset["spec"]["serviceName"])]
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"] == WORKER_SELECTOR
    published = {port["targetPort"]: port["port"] for port in service["spec"]["ports"]}
    assert published == container_ports(container) == {"grpc": PORT, "tinker": TINKER_PORT}
    assert {port["protocol"] for port in service["spec"]["ports"]} == {"TCP"}


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
    assert container_ports(container)["grpc"] == PORT
    assert str(PORT) in only(runtime, "EXPOSE").split()
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
    deploy_objects, statefulset, container
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
    assert ("PersistentVolumeClaim", claim["claimName"]) in deploy_objects


def test_the_token_comes_from_a_secret_file(statefulset, container, example_secrets):
    token_file = Path(parse_serve(container["args"]).token_file)
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == str(token_file.parent))
    assert mount["readOnly"] is True
    volumes = {v["name"]: v for v in statefulset["spec"]["template"]["spec"]["volumes"]}
    secret = volumes[mount["name"]]["secret"]
    (item,) = secret["items"]
    assert item["path"] == token_file.name
    assert secret["defaultMode"] & 0o007 == 0, "the token is not world-readable"
    # The example Secret has that name and key, and a placeholder that is clearly one.
    example = example_secrets[secret["secretName"]]
    assert example["type"] == "Opaque"
    assert example["stringData"][item["key"]].startswith("REPLACE-ME")
    assert "token" not in {e.get("name") for e in container.get("env", [])}


def test_the_network_policy_admits_the_dispatcher_on_grpc_and_tinker_clients_on_the_front(
    deploy_objects, container
):
    (policy,) = [d for (kind, _), d in deploy_objects.items() if kind == "NetworkPolicy"]
    spec = policy["spec"]
    assert spec["podSelector"]["matchLabels"] == WORKER_SELECTOR
    assert "Ingress" in spec["policyTypes"]
    dispatcher, tinker_clients = spec["ingress"]
    ports = container_ports(container)
    assert dispatcher["from"] == [{"podSelector": {"matchLabels": DISPATCHER_LABELS}}]
    assert dispatcher["ports"] == [{"port": ports["grpc"], "protocol": "TCP"}]
    # The SDK's clients reach the front only, never the gRPC port (nor the reverse).
    assert tinker_clients["from"] == [{"podSelector": {"matchLabels": TINKER_CLIENT_LABELS}}]
    assert tinker_clients["ports"] == [{"port": ports["tinker"], "protocol": "TCP"}]
    assert spec.get("egress", []) == [] and "Egress" in spec["policyTypes"]


def test_the_disruption_budget_covers_the_workers(deploy_objects, statefulset):
    (budget,) = [d for (kind, _), d in deploy_objects.items() if kind == "PodDisruptionBudget"]
    selector = budget["spec"]["selector"]["matchLabels"]
    assert selector == statefulset["spec"]["selector"]["matchLabels"]
    assert selector.items() <= statefulset["spec"]["template"]["metadata"]["labels"].items()
    assert budget["spec"]["maxUnavailable"] == 1


def test_the_service_account_and_the_image_are_the_ones_referenced(
    deploy_objects, kustomization, statefulset, container
):
    name = statefulset["spec"]["template"]["spec"]["serviceAccountName"]
    assert deploy_objects[("ServiceAccount", name)]["automountServiceAccountToken"] is False
    assert [image["name"] for image in kustomization["images"]] == [container["image"]]


def test_the_example_secrets_hold_placeholders_only(example_secrets):
    for secret in example_secrets.values():
        for name, value in secret["stringData"].items():
            assert "BEGIN" not in value, "no PEM blocks, not even fake ones"
            if name == "tenants.yaml":  # a map whose every key is a placeholder
                keys = [tenant["key"] for tenant in yaml.safe_load(value)["tenants"]]
                assert keys and all(key.startswith("tml-REPLACE-ME") for key in keys)
            else:
                assert value.startswith("REPLACE-ME"), "examples hold placeholders only"
