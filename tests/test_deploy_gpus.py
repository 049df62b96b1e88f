"""One session on a pod's N GPUs (deploy/components/gpus), without a cluster.

The component is rendered into deploy/ as `kubectl kustomize` renders it (and compared with the
real one where kubectl is installed); the rank processes' command line is parsed by `trainwire
serve`'s own parser.
"""

from __future__ import annotations

import re

import pytest
import yaml
from deploy_files import (
    DEPLOY,
    STATEFULSET,
    by_kind_and_name,
    deploy_kustomization,
    gibibytes,
    gpus,
    kubectl_kustomize,
    manifest_files,
    needs_kubectl,
    option,
    parse_serve,
)
from kustomize_render import rendered, rendered_statefulset

GPUS = DEPLOY / "components" / "gpus"


# ---- one pod, N GPUs: components/gpus ----------------------------------------------------------


def test_the_gpus_component_lists_its_files_and_patches_the_worker():
    component = yaml.safe_load((GPUS / "kustomization.yaml").read_text())
    assert component["kind"] == "Component"
    assert {patch["path"] for patch in component["patches"]} == manifest_files(GPUS)
    for patch in component["patches"]:
        assert patch["target"] == {
            "group": "apps",
            "version": "v1",
            "kind": STATEFULSET[0],
            "name": STATEFULSET[1],
        }
    # The default deployment stays one GPU per session: the component is opt-in.
    assert "components/gpus" not in deploy_kustomization().get("components", [])


@pytest.mark.parametrize("components", [("gpus",), ("gpus", "tls", "tls-client-auth")])
def test_one_pod_spawns_one_rank_per_gpu_it_is_given(components):
    running = rendered_statefulset(*components)["spec"]["template"]["spec"]["containers"][0]
    arguments = running["args"]
    assert int(option(arguments, "--nproc")) == gpus(running) > 1
    assert option(arguments, "--device") == "cuda"
    settings = parse_serve(arguments)
    assert settings.nproc == gpus(running)
    assert settings.device == "cuda"


def test_n_is_written_once_in_the_gpus_patch():
    text = (GPUS / "statefulset-patch.yaml").read_text()
    assert len(re.findall(r"^  value: &gpus ", text, re.MULTILINE)) == 1
    operations = yaml.safe_load(text)
    (nproc,) = [o for o in operations if o.get("value") == "--nproc"]
    anchored = operations[operations.index(nproc) + 1]
    assert anchored["path"] == nproc["path"] == "/spec/template/spec/containers/0/args/-"
    assert isinstance(anchored["value"], str), "container arguments are strings"
    # Every GPU count in the patch is the anchor (`*gpus`), never a second literal.
    counts = re.findall(r"nvidia\.com/gpu: (\S+)", text)
    assert counts and set(counts) == {"*gpus"}


def test_one_pod_gets_shared_memory_for_nccl_within_its_memory():
    pod = rendered_statefulset("gpus")["spec"]["template"]["spec"]
    (running,) = pod["containers"]
    shm = next(m for m in running["volumeMounts"] if m["mountPath"] == "/dev/shm")
    volume = next(v for v in pod["volumes"] if v["name"] == shm["name"])
    assert volume["emptyDir"]["medium"] == "Memory"
    # A memory-backed emptyDir counts against the container's memory limit.
    limits, requests = running["resources"]["limits"], running["resources"]["requests"]
    assert limits["memory"] == requests["memory"]
    assert gibibytes(volume["emptyDir"]["sizeLimit"]) < gibibytes(limits["memory"])


def test_one_pod_keeps_the_workers_probes_and_security(statefulset):
    patched = rendered_statefulset("gpus")
    (running,) = patched["spec"]["template"]["spec"]["containers"]
    (original,) = statefulset["spec"]["template"]["spec"]["containers"]
    for field in ("ports", "startupProbe", "readinessProbe", "livenessProbe", "securityContext"):
        assert running[field] == original[field], field
    pod, original_pod = patched["spec"]["template"]["spec"], statefulset["spec"]["template"]["spec"]
    assert pod["securityContext"] == original_pod["securityContext"]


@needs_kubectl
def test_kubectl_kustomize_renders_the_gpus_component_as_these_tests_read_it(tmp_path):
    gpus_only = kubectl_kustomize(DEPLOY, ["components/gpus"], tmp_path)
    assert by_kind_and_name(gpus_only) == by_kind_and_name(rendered("gpus"))
