"""One session on several pods (deploy/multi-pod), without a cluster.

The LeaderWorkerSet is rendered from its own folder (and compared with `kubectl kustomize`
where kubectl is installed). Built-in kinds are validated against the
Kubernetes schemas; the LeaderWorkerSet (a custom resource, whose schema kubernetes-validate does
not ship) by its envelope's fields and its two pod templates as PodTemplates. Command lines are
parsed as they run: `trainwire serve`'s own parser, and torchrun's flags by a small mirror that is
checked against torchrun's real parser where torch is installed.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml
from deploy_files import (
    DISPATCHER_LABELS,
    LEADER_SERVICE,
    LEADER_WORKER_SET,
    LWS_NAME_LABEL,
    LWS_WORKER_INDEX_LABEL,
    MULTI_POD,
    PORT,
    SHARDED_SELECTOR,
    STATE_CLAIM_FILE,
    TINKER_CLIENT_LABELS,
    TINKER_PORT,
    TLS_PROBE,
    TORCHRUN_MASTER_PORT,
    by_kind_and_name,
    container_ports,
    deploy_kustomization,
    env_values,
    gibibytes,
    gpus,
    kubectl_kustomize,
    listen_port,
    lws_environment,
    manifest_files,
    multi_pod_kustomization,
    only_container,
    parse_serve,
    pod_command,
    pod_templates,
    secret_file,
    serve_settings,
    state_claim,
    torchrun_parser,
)
from kustomize_render import render, rendered_statefulset, retag
from test_deploy import validate_against_schemas

MULTI_POD_TLS_PROBE = MULTI_POD / "components" / "tls" / TLS_PROBE.name
# The LeaderWorkerSet fields these manifests may use: those of LeaderWorkerSetSpec and
# LeaderWorkerTemplate since v0.6 (the first release that sets LWS_WORKER_INDEX).
LWS_SPEC_FIELDS = {"replicas", "leaderWorkerTemplate", "rolloutStrategy", "startupPolicy"}
LWS_TEMPLATE_FIELDS = {"leaderTemplate", "workerTemplate", "size", "restartPolicy"}


# ---- reading the manifests ---------------------------------------------------------------------


def render_multi_pod(*components: str) -> dict[tuple[str, str], dict]:
    """deploy/multi-pod rendered with ``components`` (under its components/) enabled, by name.

    The Python rendering retags pod templates under spec.template only; kustomize retags every
    ``containers`` list, the LeaderWorkerSet's two templates included, and so does this.
    """
    kustomization = multi_pod_kustomization()
    kustomization["components"] = [f"components/{component}" for component in components]
    documents = render(kustomization, MULTI_POD)
    for document in documents:
        if document["kind"] == LEADER_WORKER_SET[0]:
            for template in pod_templates(document):
                for image in kustomization["images"]:
                    retag({"spec": {"template": template}}, image)
    return {(d["kind"], d["metadata"]["name"]): d for d in documents}


# ---- several pods: deploy/multi-pod ------------------------------------------------------------


def test_the_multi_pod_kustomization_lists_every_manifest_but_the_state_claim():
    kustomization = multi_pod_kustomization()
    assert kustomization["kind"] == "Kustomization"
    resources = kustomization["resources"]
    assert len(resources) == len(set(resources))
    # The state claim is applied by hand, so `kubectl delete -k` never takes checkpoints with it.
    assert set(resources) == manifest_files(MULTI_POD) - {STATE_CLAIM_FILE}
    assert kustomization["namespace"] == deploy_kustomization()["namespace"]
    assert kustomization["images"] == deploy_kustomization()["images"]
    assert "secretGenerator" not in kustomization and "components" not in kustomization
    for component in ("tls", "tls-client-auth"):
        assert f"#   - components/{component}" in (MULTI_POD / "kustomization.yaml").read_text()


def multi_pod_documents() -> list[tuple[str, dict]]:
    documents = [(STATE_CLAIM_FILE, state_claim())]
    for components in ((), ("tls",), ("tls", "tls-client-auth")):
        name = "multi-pod" + "".join(f" + components/{c}" for c in components)
        for (kind, object_name), document in render_multi_pod(*components).items():
            if kind != LEADER_WORKER_SET[0]:
                documents.append((f"{name}: {kind} {object_name}", document))
                continue
            for role, template in zip(("leader", "worker"), pod_templates(document), strict=True):
                pod_template = {
                    "apiVersion": "v1",
                    "kind": "PodTemplate",
                    "metadata": {"name": f"{object_name}-{role}"},
                    "template": template,
                }
                documents.append((f"{name}: {kind} {object_name} {role}", pod_template))
    documents.append(("one pod: gpus + tls", rendered_statefulset("gpus", "tls")))
    return documents


@pytest.mark.parametrize(
    "document", [pytest.param(document, id=name) for name, document in multi_pod_documents()]
)
def test_every_sharded_manifest_validates_against_the_kubernetes_schemas(document):
    validate_against_schemas(document)


def test_the_leader_worker_set_recreates_its_group_and_uses_only_its_api_fields():
    leader_worker_set = render_multi_pod()[LEADER_WORKER_SET]
    assert leader_worker_set["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    spec = leader_worker_set["spec"]
    assert set(spec) <= LWS_SPEC_FIELDS
    assert set(spec["leaderWorkerTemplate"]) <= LWS_TEMPLATE_FIELDS
    assert spec["leaderWorkerTemplate"]["restartPolicy"] == "RecreateGroupOnPodRestart"
    # The leader is Ready only once every worker has joined: LeaderReady would deadlock.
    assert spec["startupPolicy"] == "LeaderCreated"
    # One group is one session with one state claim.
    assert spec["replicas"] == 1
    assert spec["leaderWorkerTemplate"]["size"] >= 2
    for template in pod_templates(leader_worker_set):
        assert SHARDED_SELECTOR.items() <= template["metadata"]["labels"].items()


def test_every_pod_runs_torchrun_as_one_node_of_the_group():
    leader_worker_set = render_multi_pod()[LEADER_WORKER_SET]
    size = leader_worker_set["spec"]["leaderWorkerTemplate"]["size"]
    leader, worker = (only_container(t) for t in pod_templates(leader_worker_set))
    # One command line for every pod: torchrun tells them apart (--node-rank).
    assert leader["command"] == worker["command"] == ["torchrun"]
    assert leader["args"] == worker["args"]
    for worker_index in range(size):
        command = pod_command(leader_worker_set, worker_index)
        launch = torchrun_parser().parse_args(command[1:])
        assert launch.nnodes == str(size)
        assert launch.node_rank == worker_index
        assert launch.master_addr == lws_environment(leader_worker_set, 0)["LWS_LEADER_ADDRESS"]
        assert launch.master_port == TORCHRUN_MASTER_PORT
        assert launch.max_restarts == 0
        assert launch.module and launch.training_script == "trainwire"
        subcommand, *serve_arguments = launch.training_script_args
        assert subcommand == "serve"
        settings = parse_serve(serve_arguments)
        assert settings.device == "cuda"
        assert settings.listen == f"0.0.0.0:{PORT}"
        # Under torchrun the ranks come from torchrun: no --nproc.
        assert "--nproc" not in serve_arguments
        running = leader if worker_index == 0 else worker
        assert int(launch.nproc_per_node) == gpus(running)


def test_the_image_has_torchrun_on_its_path(dockerfile, runtime):
    # torchrun is torch's console script, in the virtual environment the runtime stage copies.
    assert any(k == "RUN" and "torch==" in arguments for k, arguments in dockerfile)
    assert "/opt/venv/bin" in env_values(runtime)["PATH"].split(":")
    assert ("COPY", "--from=builder /opt/venv /opt/venv") in runtime


def test_the_torchrun_mirror_reads_the_command_as_torchrun_does():
    run = pytest.importorskip("torch.distributed.run")
    leader_worker_set = render_multi_pod()[LEADER_WORKER_SET]
    command = pod_command(leader_worker_set, 1)
    mirrored = torchrun_parser().parse_args(command[1:])
    real = run.get_args_parser().parse_args(command[1:])
    for field in vars(mirrored):
        assert str(getattr(real, field)) == str(getattr(mirrored, field)), field


def test_the_leader_service_selects_only_the_leader_on_its_grpc_and_tinker_ports():
    objects = render_multi_pod()
    service, leader_worker_set = objects[LEADER_SERVICE], objects[LEADER_WORKER_SET]
    selector = service["spec"]["selector"]
    assert selector == {
        **SHARDED_SELECTOR,
        LWS_NAME_LABEL: leader_worker_set["metadata"]["name"],
        LWS_WORKER_INDEX_LABEL: "0",
    }
    # LeaderWorkerSet creates a headless Service named after itself: this one must not clash.
    assert service["metadata"]["name"] != leader_worker_set["metadata"]["name"]
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is True
    published = {port["targetPort"]: port["port"] for port in service["spec"]["ports"]}
    leader = only_container(pod_templates(leader_worker_set)[0])
    assert published == {"grpc": PORT, "tinker": TINKER_PORT}
    # torchrun's store stays unpublished: only the group's own pods dial it.
    assert container_ports(leader) == {**published, "rendezvous": TORCHRUN_MASTER_PORT}
    assert listen_port(serve_settings(leader).tinker_listen) == TINKER_PORT


def test_only_the_leader_is_probed_by_grpc_health():
    leader_worker_set = render_multi_pod()[LEADER_WORKER_SET]
    leader, worker = (only_container(t) for t in pod_templates(leader_worker_set))
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert leader[probe]["grpc"] == {"port": PORT}, probe
        assert probe not in worker, f"workers have no listener: no {probe}"
    assert "ports" not in worker
    startup, liveness = leader["startupProbe"], leader["livenessProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 15 * 60
    assert liveness["periodSeconds"] * liveness["failureThreshold"] >= 10 * 60


def test_every_pod_mounts_one_read_write_many_state_claim_and_the_models_read_only(
    deploy_objects,
):
    claim = state_claim()
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    for template in pod_templates(render_multi_pod()[LEADER_WORKER_SET]):
        running = only_container(template)
        settings = serve_settings(running)
        mounts = {m["mountPath"]: m for m in running["volumeMounts"]}
        volumes = {v["name"]: v for v in template["spec"]["volumes"]}
        state = mounts[settings.state_dir]
        assert not state.get("readOnly", False) and "subPath" not in state
        assert volumes[state["name"]]["persistentVolumeClaim"] == {
            "claimName": claim["metadata"]["name"]
        }
        models = mounts[settings.model_root]
        assert models["readOnly"] is True
        models_claim = volumes[models["name"]]["persistentVolumeClaim"]
        assert models_claim["readOnly"] is True
        # The same model root as deploy/'s workers.
        assert ("PersistentVolumeClaim", models_claim["claimName"]) in deploy_objects
        shm = volumes[mounts["/dev/shm"]["name"]]
        assert shm["emptyDir"]["medium"] == "Memory"
        memory = running["resources"]["limits"]["memory"]
        assert gibibytes(shm["emptyDir"]["sizeLimit"]) < gibibytes(memory)


def test_every_pod_has_the_workers_security_and_token(statefulset):
    objects = render_multi_pod()
    worker_pod = statefulset["spec"]["template"]["spec"]
    (worker_container,) = worker_pod["containers"]
    worker_volumes = {v["name"]: v for v in worker_pod["volumes"]}
    for template in pod_templates(objects[LEADER_WORKER_SET]):
        pod, running = template["spec"], only_container(template)
        assert pod["securityContext"] == worker_pod["securityContext"]
        assert running["securityContext"] == worker_container["securityContext"]
        assert pod["tolerations"] == worker_pod["tolerations"]
        assert pod["automountServiceAccountToken"] is False
        assert pod["enableServiceLinks"] is False
        account = objects[("ServiceAccount", pod["serviceAccountName"])]
        assert account["automountServiceAccountToken"] is False
        volumes = {v["name"]: v for v in pod["volumes"]}
        token_file = Path(serve_settings(running).token_file)
        assert token_file == Path(parse_serve(worker_container["args"]).token_file)
        token = next(m for m in running["volumeMounts"] if m["mountPath"] == str(token_file.parent))
        assert token["readOnly"] is True
        assert volumes[token["name"]] == worker_volumes[token["name"]]
        tmp = next(m for m in running["volumeMounts"] if m["mountPath"] == "/tmp")
        assert volumes[tmp["name"]] == worker_volumes[tmp["name"]]
        # The Tinker front's tenants map: the same file from the same Secret as deploy/'s.
        tenants_file = serve_settings(running).tinker_token_file
        assert tenants_file == parse_serve(worker_container["args"]).tinker_token_file
        mount, secret = secret_file(pod, running, tenants_file)
        assert secret == worker_volumes[mount["name"]]["secret"]


def test_the_network_policy_admits_the_dispatcher_tinker_clients_and_the_sessions_pods():
    objects = render_multi_pod()
    spec = objects[("NetworkPolicy", "trainwire-sharded")]["spec"]
    assert spec["podSelector"]["matchLabels"] == SHARDED_SELECTOR
    assert set(spec["policyTypes"]) == {"Ingress", "Egress"}
    dispatcher, tinker_clients, ranks = spec["ingress"]
    assert dispatcher["from"] == [{"podSelector": {"matchLabels": DISPATCHER_LABELS}}]
    assert dispatcher["ports"] == [{"port": PORT, "protocol": "TCP"}]
    assert tinker_clients["from"] == [{"podSelector": {"matchLabels": TINKER_CLIENT_LABELS}}]
    assert tinker_clients["ports"] == [{"port": TINKER_PORT, "protocol": "TCP"}]
    # torchrun's store and NCCL's ports, between the session's pods only.
    assert ranks == {"from": [{"podSelector": {"matchLabels": SHARDED_SELECTOR}}]}
    peers, dns = spec["egress"]
    assert peers == {"to": [{"podSelector": {"matchLabels": SHARDED_SELECTOR}}]}
    assert {(p["port"], p["protocol"]) for p in dns["ports"]} == {(53, "UDP"), (53, "TCP")}
    # The pods are not deploy/'s workers: its policy (no egress) and Service do not select them.
    pod_labels = pod_templates(objects[LEADER_WORKER_SET])[1]["metadata"]["labels"]
    assert pod_labels["app.kubernetes.io/component"] != "worker"


def test_the_multi_pod_tls_components_reach_every_rank_and_probe_the_leader_over_tls(
    example_secrets,
):
    assert MULTI_POD_TLS_PROBE.read_text() == TLS_PROBE.read_text(), "keep the copy identical"
    for component in ("tls", "tls-client-auth"):
        folder = MULTI_POD / "components" / component
        spec = yaml.safe_load((folder / "kustomization.yaml").read_text())
        generated = {f for g in spec.get("configMapGenerator", []) for f in g["files"]}
        listed = {patch["path"] for patch in spec["patches"]} | generated
        assert listed == manifest_files(folder) | {p.name for p in folder.glob("*.py")}
    objects = render_multi_pod("tls", "tls-client-auth")
    (config_map,) = [d for (kind, _), d in objects.items() if kind == "ConfigMap"]
    assert config_map["data"] == {TLS_PROBE.name: TLS_PROBE.read_text()}
    generator = yaml.safe_load((MULTI_POD / "components/tls/kustomization.yaml").read_text())
    # kustomize would not rewrite a hashed name inside a LeaderWorkerSet: keep it as written.
    assert generator["configMapGenerator"][0]["options"]["disableNameSuffixHash"] is True
    leader_template, worker_template = pod_templates(objects[LEADER_WORKER_SET])
    for template in (leader_template, worker_template):
        running = only_container(template)
        settings = serve_settings(running)
        mounts = {m["mountPath"]: m for m in running["volumeMounts"]}
        volumes = {v["name"]: v for v in template["spec"]["volumes"]}
        tls_directory = Path(settings.tls_cert).parent
        secret = volumes[mounts[str(tls_directory)]["name"]]["secret"]
        assert example_secrets[secret["secretName"]]["type"] == "kubernetes.io/tls"
        for path in (settings.tls_cert, settings.tls_key, settings.tls_client_ca):
            assert Path(path).parent == tls_directory
    leader = only_container(leader_template)
    (probe_volume,) = [v for v in leader_template["spec"]["volumes"] if "configMap" in v]
    assert probe_volume["configMap"]["name"] == config_map["metadata"]["name"]
    probe_mount = next(m for m in leader["volumeMounts"] if m["name"] == probe_volume["name"])
    probe = [
        "/opt/venv/bin/python",
        str(Path(probe_mount["mountPath"]) / TLS_PROBE.name),
        str(PORT),
    ]
    for name in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert leader[name] == {**leader[name], "exec": {"command": probe}}
        assert "grpc" not in leader[name]
        assert name not in only_container(worker_template)
    environment = {e["name"]: e for e in leader["env"]}
    assert environment["TRAINWIRE_TLS_SERVER_NAME"]["value"] == (
        f"{LEADER_SERVICE[1]}.$(POD_NAMESPACE).svc"
    )


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_kubectl_kustomize_renders_the_multi_pod_group_as_these_tests_read_it(tmp_path):
    components = ["components/tls", "components/tls-client-auth"]
    multi_pod = kubectl_kustomize(MULTI_POD, components, tmp_path)
    assert by_kind_and_name(multi_pod) == render_multi_pod("tls", "tls-client-auth")
