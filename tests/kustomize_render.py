"""deploy/ rendered in Python as `kubectl kustomize` renders it, so no test needs kubectl.

Resources, components with their JSON 6902 patches and ConfigMap generators, the namespace and the
images transformers: what deploy/ uses, and a kustomization that uses more fails here first.
"""

from __future__ import annotations

import copy
from pathlib import Path

import yaml
from deploy_files import DEPLOY, STATEFULSET, deploy_kustomization, load_documents


class PatchTestFailed(AssertionError):
    """A JSON patch's `test` found another value: kustomize fails the build there too."""


def json_patch(document: dict, operations: list[dict]) -> dict:
    """RFC 6902 `add`, `replace` and `test`, which is all the components use."""
    result = copy.deepcopy(document)
    for operation in operations:
        assert operation["op"] in ("add", "replace", "test"), operation
        *parents, last = operation["path"].lstrip("/").split("/")
        target = result
        for part in parents:
            target = target[int(part)] if isinstance(target, list) else target[part]
        value = copy.deepcopy(operation["value"])
        if operation["op"] == "test":
            found = target[int(last)] if isinstance(target, list) else target.get(last)
            if found != value:
                raise PatchTestFailed(f"{operation['path']} is {found!r}, not {value!r}")
            continue
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
    kustomization = deploy_kustomization()
    kustomization["components"] = [f"components/{component}" for component in components]
    return render(kustomization)


def rendered_statefulset(*components: str) -> dict:
    (statefulset,) = [d for d in rendered(*components) if d["kind"] == STATEFULSET[0]]
    return statefulset
