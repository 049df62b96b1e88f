"""Values computed once and written down in ``reference_values.json``, checked against what this
machine computes now: "the plan is identical on every machine, Python version and process" and
"a run's bits are reproducible" are held to values computed elsewhere, not only compared within
one interpreter or across hash seeds in one checkout.

The tiny run's digest depends on torch's kernels, so it is pinned with the torch version that
computed it (the one CI installs, the Makefile's) and skipped, saying why, under another torch;
and on another CPU capability (AVX2, AVX512: other kernels, other roundings), both recorded. The
plan needs no torch and is never skipped.

Regenerate with ``.venv/bin/python tests/test_reference_values.py`` only when a change means to
change these bits (a new plan algorithm, a new digest format, a torch upgrade), and say so in
the commit; never to make a failing check pass.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

REFERENCE_FILE = Path(__file__).with_name("reference_values.json")

# The plan, as a script a fresh interpreter runs: its fingerprint and every microbatch, as JSON.
PLAN_SCRIPT = """
import json
from trainwire.client import InputExample, ManagedTrainingPlan, TrainingConfig
examples = [InputExample("example %d" % i, completion="c" * (i % 5 + 1)) for i in range(50)]
config = TrainingConfig(
    model="m", batch_size=4, num_epochs=2, gradient_accumulation_steps=3, group_by_length=True
)
plan = ManagedTrainingPlan(examples, config)
manifest = plan.to_manifest()
print(json.dumps({"fingerprint": plan.fingerprint, "microbatches": manifest["microbatches"]}))
"""


def reference() -> dict[str, Any]:
    return json.loads(REFERENCE_FILE.read_text())


def computed_plan(hash_seed: str) -> dict[str, Any]:
    """The plan as a fresh interpreter with ``PYTHONHASHSEED=hash_seed`` computes it."""
    env = dict(os.environ, PYTHONHASHSEED=hash_seed)
    out = subprocess.run(
        [sys.executable, "-c", PLAN_SCRIPT], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout)


def tiny_run_digests(model: Path) -> dict[str, str]:
    """The final state digest of the smallest run that touches every part of the state: two
    updates of the tiny llama (text and token microbatches, accumulation, a linear schedule),
    full weights and LoRA with dropout (the session's RNG), on one CPU thread (a matmul's bits
    depend on the thread count)."""
    import torch
    from fresh_state import fresh_digest

    from trainwire.client import LoraSettings, TrainingConfig
    from trainwire.server.engine.session import TrainingSession
    from trainwire.testing import tiny_text_examples, tiny_token_examples

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        digests = {}
        for name, lora in (("full", None), ("lora", LoraSettings(r=4, alpha=8, dropout=0.1))):
            config = TrainingConfig(
                model=str(model), task="causal-lm", batch_size=3, max_length=64, lora=lora
            )
            session = TrainingSession(config, max_steps=2, device="cpu")
            session.forward_backward(tiny_text_examples(3))
            session.forward_backward(tiny_token_examples(3, seed=1))
            session.optim_step()
            session.forward_backward(tiny_text_examples(3, seed=2))
            session.optim_step()
            digests[name] = fresh_digest(session)
        return digests
    finally:
        torch.set_num_threads(threads)


def torch_release() -> str:
    """The installed torch's version without its build tag (2.13.0+cpu and +cu128 alike)."""
    import torch

    return torch.__version__.split("+")[0]


def cpu_capability() -> str:
    import torch

    return torch.backends.cpu.get_cpu_capability()


@pytest.mark.parametrize("hash_seed", ["0", "1", "12345"])
def test_the_plan_is_the_pinned_one_in_every_process_and_hash_seed(hash_seed: str) -> None:
    pinned = reference()["plan"]
    computed = computed_plan(hash_seed)
    assert computed["fingerprint"] == pinned["fingerprint"]
    assert computed["microbatches"] == pinned["microbatches"]


def test_a_tiny_run_ends_at_the_pinned_digest(tiny_llama: Path) -> None:
    pinned = reference()["tiny_run"]
    if torch_release() != pinned["torch"]:
        pytest.skip(
            f"the tiny run's digest was pinned under torch {pinned['torch']}; torch "
            f"{torch_release()} may compute other bits (regenerate it there, see the docstring)"
        )
    if cpu_capability() != pinned["cpu_capability"]:
        pytest.skip(
            f"the tiny run's digest was pinned on a {pinned['cpu_capability']} CPU; this one's "
            f"kernels are {cpu_capability()}, whose fp32 sums may round otherwise (regenerate "
            "it here to check this kind of CPU, see the docstring)"
        )
    assert tiny_run_digests(tiny_llama) == pinned["digests"]


def write_reference() -> None:
    """Compute every value here, in fresh processes and a fresh tiny model, and write them."""
    from trainwire.testing import make_tiny_model

    with tempfile.TemporaryDirectory() as directory:
        digests = tiny_run_digests(make_tiny_model(Path(directory) / "llama"))
    values = {
        "about": (
            "Pinned by tests/test_reference_values.py (its docstring says when to regenerate: "
            "run it as a script). The plan needs no torch; the tiny run is its torch's."
        ),
        "plan": computed_plan("0"),
        "tiny_run": {
            "torch": torch_release(),
            "python": platform.python_version(),
            "cpu_capability": cpu_capability(),
            "digests": digests,
        },
    }
    REFERENCE_FILE.write_text(dumps(values))


def dumps(values: dict[str, Any]) -> str:
    """JSON with one microbatch a line, so a regenerated plan's diff shows the rows it moved."""
    plan = values["plan"]
    placeholder = "MICROBATCHES"
    text = json.dumps({**values, "plan": {**plan, "microbatches": placeholder}}, indent=1)
    rows = ",\n   ".join(json.dumps(microbatch) for microbatch in plan["microbatches"])
    return text.replace(f'"{placeholder}"', f"[\n   {rows}\n  ]") + "\n"


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))  # fresh_state, as pytest finds it
    write_reference()
