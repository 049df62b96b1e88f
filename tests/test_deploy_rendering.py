"""deploy/ rendered as `kubectl kustomize` renders it (kustomize_render.py): every manifest in its
namespace with the tagged image, and the TLS components, once enabled, patched into the worker.
"""

from __future__ import annotations

from pathlib import Path

import yaml
from deploy_files import DEPLOY, PORT, STATEFULSET, TLS_PROBE, WORKER_SELECTOR, parse_serve
from kustomize_render import render, rendered, rendered_statefulset


def test_the_kustomization_renders_every_manifest_in_its_namespace_with_the_tagged_image(
    deploy_objects,
):
    documents = rendered()
    assert {(d["kind"], d["metadata"]["name"]) for d in documents} == set(deploy_objects)
    assert {d["metadata"]["namespace"] for d in documents} == {"trainwire"}
    (statefulset,) = [d for d in documents if d["kind"] == STATEFULSET[0]]
    assert statefulset["spec"]["template"]["spec"]["containers"][0]["image"] == (
        "trainwire-worker:0.1.0"
    )


def test_uncommenting_the_components_renders_the_tls_probe_the_pods_mount_on_their_gpus():
    text = (DEPLOY / "kustomization.yaml").read_text()
    text = text.replace("# components:", "components:").replace(
        "#   - components/", "  - components/"
    )
    kustomization = yaml.safe_load(text)
    assert kustomization["components"] == [
        "components/tls",
        "components/tls-client-auth",
        "components/gpus",
        "components/lab",
    ]
    # lab is gpus' alternative, not its companion: a session across several GPUs holds one run.
    kustomization["components"].remove("components/lab")
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
    assert "--nproc" in pod["containers"][0]["args"]


def test_the_tls_components_pass_the_secret_files_and_probe_over_tls(statefulset, example_secrets):
    patched = rendered_statefulset("tls", "tls-client-auth")
    pod = patched["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    settings = parse_serve(container["args"])
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    tls_directory = Path(settings.tls_cert).parent
    (tls,) = [m for m in mounts.values() if m["mountPath"] == str(tls_directory)]
    secret = volumes[tls["name"]]["secret"]
    example = example_secrets[secret["secretName"]]
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
