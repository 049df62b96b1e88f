"""The Python rendering of deploy/ (kustomize_render.py), which the deployment tests read, is what
the real `kubectl kustomize` renders, for the base and every component combination the tests use.

One difference is kustomize's own and deliberate: a generated ConfigMap's name carries a hash of
its contents (``trainwire-tls-probe-g4h5tbhghd``), and every reference to it follows. The Python
rendering keeps the plain name; the comparison maps the hashed names back, and nothing else.

CI installs kubectl (.ci/run), so there this check always runs; elsewhere it is skipped, saying
so, only where kubectl is missing."""

from __future__ import annotations

import json
import re

import pytest
from deploy_files import DEPLOY, by_kind_and_name, kubectl_kustomize, needs_kubectl
from kustomize_render import rendered

COMBINATIONS = [
    (),
    ("tls",),
    ("tls", "tls-client-auth"),
    ("gpus",),
    ("tls", "gpus"),
    ("lab",),
    ("tls", "lab"),
]
NAME_HASH = re.compile(r"-[a-z0-9]{10}$")  # kustomize's suffix on a generated name


def without_name_hashes(documents: list[dict], plain_names: set[str]) -> list[dict]:
    """``documents`` with each generated ConfigMap's hashed name (and every mention of it)
    back to the plain name the Python rendering gives it."""
    text = json.dumps(documents)
    for document in documents:
        name = document["metadata"]["name"]
        plain = NAME_HASH.sub("", name)
        if document["kind"] == "ConfigMap" and plain != name and plain in plain_names:
            text = text.replace(json.dumps(name), json.dumps(plain))
    return json.loads(text)


@needs_kubectl
@pytest.mark.parametrize("components", COMBINATIONS, ids=lambda c: "+".join(c) or "base")
def test_the_python_rendering_is_kubectl_kustomize(components, tmp_path):
    ours = rendered(*components)
    real = kubectl_kustomize(DEPLOY, [f"components/{c}" for c in components], tmp_path)
    plain_names = {d["metadata"]["name"] for d in ours if d["kind"] == "ConfigMap"}
    assert by_kind_and_name(ours) == by_kind_and_name(without_name_hashes(real, plain_names))
