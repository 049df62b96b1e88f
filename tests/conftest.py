"""Shared fixtures: tiny real models built once per test session, and config factories.

Every model lives under one session-wide ``model_root`` directory, so a test can open a session
either by absolute path (``config.model``) or relative to ``model_root=model_root``. Models are
built offline by :func:`trainwire.testing.make_tiny_model` (about a second for all of them) and
must be treated as read-only: a test that needs to change a model copies it first.

Fixtures:
    model_root: the directory holding every tiny model below.
    tiny_llama: a causal-lm llama (``make_tiny_model(arch="llama")``).
    tiny_bert_classifier: a bert sequence classifier over ``SENTIMENT_LABELS``.
    tiny_llama_classifier: a llama sequence classifier over ``SENTIMENT_LABELS``.
    llama_config, bert_classifier_config, llama_classifier_config: factories
        ``(**overrides) -> TrainingConfig`` for the models above with small, fast defaults
        (``SMALL_SETTINGS``); any config field can be overridden. The schedule stays the
        default ``linear``: a session that steps needs ``max_steps`` (the plan's), or pass
        ``lr_scheduler="constant"``.
    small_lora: ``LoraSettings(r=4, alpha=8, dropout=0.1)``; dropout makes the session's RNG
        take part in every training step, so RNG bugs show up in digests.

The session host tests share (keyed operations on a host are in host_operations.py):
    make_host: ``make_host(**options)``, a recovered SessionHost on ``tmp_path / "state"``
        (CPU, the tiny models' root), released at the end of the test.
    host_config: ``llama_config()``; host: a host with run ``"run"`` open on it (10 steps,
        plan ``sha256:plan``).

The Dockerfile and deploy/ tests share fixtures over those files (readers in deploy_files.py):
    dockerfile: the Dockerfile's (INSTRUCTION, arguments) pairs; runtime: its last stage's.
    kustomization: deploy/kustomization.yaml; deploy_objects: its resources by (kind, name);
    statefulset, container: the worker StatefulSet and its one container;
    example_secrets: deploy/examples/ by name.

Tests marked ``cuda`` are skipped where torch sees no CUDA device.

torch runs on one CPU thread in the suite and in every process a test starts (see
``OMP_NUM_THREADS`` below). ``make test`` and ``make test-all`` run the suite on two pytest-xdist
workers, a test module's tests all on one of them (``--dist loadscope``: its module-scoped
fixtures are built once, and its tests run in their order). Every fixture here writes under its
own worker's ``tmp_path``; servers started as processes get ports from
``trainwire.testing.free_port``, which hands no port to two processes.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import deploy_files
import pytest

from trainwire.client import LoraSettings, TrainingConfig
from trainwire.testing import SENTIMENT_LABELS, make_tiny_model

if TYPE_CHECKING:  # the host imports torch; the fixtures import it when a test asks for one
    from trainwire.server.service.host import SessionHost

# One CPU thread for torch, here and in every process a test starts (they inherit the environment).
# The tiny models' operations are far too small to gain from a second thread, and on a machine
# whose cores are busy, OpenMP's waiting threads spin and slow each step several times over. A CPU
# computation's bits depend on the thread count, so both sides of every bit-equality check must
# use the same one: the variable is set before the tests import torch, and torch is told too if
# something imported it first. A value already set is kept, for every process alike.
os.environ.setdefault("OMP_NUM_THREADS", "1")
if "torch" in sys.modules:
    sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

SMALL_SETTINGS: dict[str, Any] = {
    "batch_size": 3,
    "max_length": 64,
    # Large enough that every update visibly moves the tiny weights.
    "learning_rate": 1e-3,
    "weight_decay": 0.01,
}
"""Defaults of the config factories: tiny batches, short examples, a visible learning rate."""

SMALL_LORA = LoraSettings(r=4, alpha=8, dropout=0.1)

ConfigFactory = Callable[..., TrainingConfig]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip ``cuda`` tests without a CUDA device (torch is imported only if there are some)."""
    cuda_items = [item for item in items if item.get_closest_marker("cuda") is not None]
    if not cuda_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in cuda_items:
        item.add_marker(skip)


@pytest.fixture(scope="session")
def model_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def tiny_llama(model_root: Path) -> Path:
    return make_tiny_model(model_root / "llama")


def _tiny_classifier(model_root: Path, arch: str) -> Path:
    return make_tiny_model(
        model_root / f"{arch}-classifier",
        arch=arch,
        task="sequence-classification",
        labels=SENTIMENT_LABELS,
    )


@pytest.fixture(scope="session")
def tiny_bert_classifier(model_root: Path) -> Path:
    return _tiny_classifier(model_root, "bert")


@pytest.fixture(scope="session")
def tiny_llama_classifier(model_root: Path) -> Path:
    return _tiny_classifier(model_root, "llama")


def _config_factory(model: Path, **fixed: Any) -> ConfigFactory:
    def make(**overrides: Any) -> TrainingConfig:
        return TrainingConfig(**{"model": str(model), **fixed, **SMALL_SETTINGS, **overrides})

    return make


@pytest.fixture(scope="session")
def llama_config(tiny_llama: Path) -> ConfigFactory:
    """``llama_config(**overrides)``: a causal-lm config for ``tiny_llama``."""
    return _config_factory(tiny_llama, task="causal-lm")


@pytest.fixture(scope="session")
def bert_classifier_config(tiny_bert_classifier: Path) -> ConfigFactory:
    """``bert_classifier_config(**overrides)``: a classification config for the bert."""
    return _config_factory(
        tiny_bert_classifier, task="sequence-classification", labels=SENTIMENT_LABELS
    )


@pytest.fixture(scope="session")
def llama_classifier_config(tiny_llama_classifier: Path) -> ConfigFactory:
    """``llama_classifier_config(**overrides)``: a classification config for the llama."""
    return _config_factory(
        tiny_llama_classifier, task="sequence-classification", labels=SENTIMENT_LABELS
    )


@pytest.fixture(scope="session")
def small_lora() -> LoraSettings:
    return SMALL_LORA


@pytest.fixture
def make_host(tmp_path: Path, model_root: Path) -> Iterator[Callable[..., SessionHost]]:
    from trainwire.server.service.host import SessionHost

    hosts = []

    def make(**options: Any) -> SessionHost:
        host = SessionHost(tmp_path / "state", model_root=model_root, device="cpu", **options)
        host.recover()
        hosts.append(host)
        return host

    yield make
    for host in hosts:
        host.release()


@pytest.fixture
def host_config(llama_config: ConfigFactory) -> TrainingConfig:
    return llama_config()


@pytest.fixture
def host(make_host: Callable[..., SessionHost], host_config: TrainingConfig) -> SessionHost:
    host = make_host()
    host.open("run", host_config, 10, "sha256:plan")
    return host


@pytest.fixture(scope="module")
def dockerfile() -> list[tuple[str, str]]:
    return deploy_files.dockerfile_instructions(deploy_files.DOCKERFILE.read_text())


@pytest.fixture(scope="module")
def runtime(dockerfile: list[tuple[str, str]]) -> list[tuple[str, str]]:
    return deploy_files.stages(dockerfile)[-1]


@pytest.fixture(scope="module")
def kustomization() -> dict:
    return deploy_files.deploy_kustomization()


@pytest.fixture(scope="module")
def deploy_objects(kustomization: dict) -> dict[tuple[str, str], dict]:
    return deploy_files.resource_objects(kustomization)


@pytest.fixture(scope="module")
def statefulset(deploy_objects: dict[tuple[str, str], dict]) -> dict:
    return deploy_objects[deploy_files.STATEFULSET]


@pytest.fixture(scope="module")
def container(statefulset: dict) -> dict:
    (only_container,) = statefulset["spec"]["template"]["spec"]["containers"]
    return only_container


@pytest.fixture(scope="module")
def example_secrets() -> dict[str, dict]:
    return deploy_files.example_documents()
