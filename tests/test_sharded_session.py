"""A session across a process group: FSDP2 shards, the batch split, one update's meaning.

Two CPU processes over gloo run each scenario (``sharded_workers``): the same operations twice
give the same digest; the loss, logprobs, metrics and gradient norm equal one process's to float
tolerance; a checkpoint resumes to the same digest; a checkpoint of 2 ranks loads on 1 and
trains; the export loads with ``from_pretrained`` and gives the sharded model's logprobs. The
rules a rank follows alone (the split, combining metrics) are checked without processes.
"""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import sharded_workers as workers
import torch
import torch.distributed.checkpoint as dcp
from peft import PeftModel
from transformers import AutoModelForCausalLM

from trainwire.server.engine.loss.token_batches import encode_token_batch, target_logprobs
from trainwire.server.engine.session import TrainingSession
from trainwire.server.engine.sharded.sharding import ShardGroup, combine_metrics
from trainwire.server.errors import FailedPrecondition, InvalidArgument

# One process and two ranks compute the same sums in another order: each rank adds its own
# examples' terms (over a batch padded to its own width), then the two halves are added, and the
# gradient shards are summed by a collective. fp32 rounds each addition to 2**-24 relative, and
# the sums here run over at most ~40 tokens, so the results may differ in the last few bits:
# ~1e-7 relative was seen, 1e-5 leaves two orders of margin while any real error (a batch
# counted twice, a mean over one rank's tokens) is off by tens of percent.
REL, ABS = 1e-5, 1e-6

MODES = {"full": (False, 0.0), "lora": (True, 0.1)}  # LoRA with dropout: the RNG takes part


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory, model_root: Path) -> dict[str, Any]:
    """Each mode's scenario on two ranks, once for the module: (spec, reports in rank order)."""
    from trainwire.testing import make_tiny_model

    model = make_tiny_model(model_root / "sharded-llama")
    runs = {}
    for mode, (lora, dropout) in MODES.items():
        out = tmp_path_factory.mktemp(f"sharded-{mode}")
        spec = {"model": str(model), "lora": lora, "dropout": dropout, "out": str(out)}
        runs[mode] = (spec, workers.launch(2, "train_and_checkpoint", spec))
    return runs


def _close(one: Any, sharded: Any, path: str = "") -> None:
    """Equal structure; floats within REL/ABS; everything else equal."""
    if isinstance(one, dict):
        assert one.keys() == sharded.keys(), path
        for key in one:
            _close(one[key], sharded[key], f"{path}.{key}")
    elif isinstance(one, list):
        assert len(one) == len(sharded), path
        for index, (a, b) in enumerate(zip(one, sharded, strict=True)):
            _close(a, b, f"{path}[{index}]")
    elif isinstance(one, float):
        assert sharded == pytest.approx(one, rel=REL, abs=ABS), path
    else:
        assert one == sharded, path


# -- the rules a rank follows alone ------------------------------------------------------------


@pytest.mark.parametrize(
    ("count", "world_size", "expected"),
    [
        (3, 2, [[0, 1], [2]]),
        (4, 2, [[0, 1], [2, 3]]),
        (7, 3, [[0, 1, 2], [3, 4], [5, 6]]),
        (5, 3, [[0, 1], [2, 3], [4]]),  # a remainder of 2: the first two ranks take one more
        (1, 2, [[0], []]),  # the second rank runs a stand-in that counts zero
    ],
)
def test_a_batch_splits_into_contiguous_slices_in_order(count, world_size, expected) -> None:
    slices = [list(ShardGroup(None, rank, world_size).rows(count)) for rank in range(world_size)]
    assert slices == expected


def test_metrics_combine_by_the_reduction_their_names_end_in() -> None:
    parts = [
        ({"loss:sum": 1.0, "ratio:mean": 1.0, "ratio:max": 2.0}, 3),
        ({"loss:sum": 2.0, "ratio:mean": 2.0, "ratio:max": 1.5}, 1),
    ]
    assert combine_metrics(parts) == {"loss:sum": 3.0, "ratio:mean": 1.25, "ratio:max": 2.0}
    with pytest.raises(FailedPrecondition, match="no known reduction"):
        combine_metrics([({"entropy": 1.0}, 1)])


def test_a_process_group_must_be_one(llama_config) -> None:
    with pytest.raises(InvalidArgument, match="process_group must be"):
        TrainingSession(llama_config(), process_group="world")


# -- two ranks ---------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_the_same_operations_on_two_ranks_give_the_same_digest_twice(two_ranks, mode) -> None:
    _, reports = two_ranks[mode]
    first, second = reports[0]["digests"]
    assert first == second
    assert [r["digests"] for r in reports] == [[first, second]] * 2  # every rank reports it
    assert reports[0]["seen"][0] == reports[0]["seen"][1] == reports[1]["seen"][0]


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_two_ranks_compute_what_one_process_computes(two_ranks, mode) -> None:
    """Text and token batches under every loss, forward and two updates: the losses, logprobs,
    metrics, rates and gradient norms one session in this process gives, to REL/ABS."""
    spec, reports = two_ranks[mode]
    config = workers.make_config(spec["model"], spec["lora"], 0.0)
    one = TrainingSession(config, max_steps=workers.MAX_STEPS)
    _close(workers.apply_operations(one), reports[0]["seen_without_dropout"])


@pytest.mark.slow
def test_two_ranks_classify_as_one_process_does(tmp_path, tiny_llama_classifier) -> None:
    """A mean over examples split over ranks, and predictions gathered in example order."""
    spec = {"model": str(tiny_llama_classifier), "out": str(tmp_path)}
    reports = workers.launch(2, "classify", spec)
    assert reports[0] == reports[1]
    one = TrainingSession(workers.classifier_config(spec["model"]))
    seen = json.loads(json.dumps(workers.classify_operations(one)))  # tuples as JSON has them
    _close(seen, reports[0]["seen"])


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_a_sharded_checkpoint_resumes_to_the_same_digest(two_ranks, mode) -> None:
    _, reports = two_ranks[mode]
    for report in reports:
        assert report["extra"] == {"note": "two ranks"}
        assert report["restored_digest"] == report["saved_digest"]
        assert report["restored_continued"] == report["continued"]
        assert report["restored_continued_digest"] == report["continued_digest"]
        assert report["continued_digest"] != report["saved_digest"]


@pytest.mark.slow
def test_a_two_rank_checkpoint_loads_on_one_rank_and_trains(two_ranks, tmp_path) -> None:
    """Another world size continues correctly, not bit for bit: the loss it starts from is the
    two ranks' (to REL/ABS), and training on lowers it."""
    cases = {
        mode: {
            "lora": spec["lora"],
            "dropout": spec["dropout"],
            "checkpoint": spec["out"] + "/checkpoint",
        }
        for mode, (spec, _) in two_ranks.items()
    }
    model = two_ranks["full"][0]["model"]
    damaged = _damaged_copy(Path(cases["full"]["checkpoint"]), tmp_path / "damaged")
    spec = {"model": model, "cases": cases, "damaged": str(damaged), "out": str(tmp_path)}
    (report,) = workers.launch(1, "resume_elsewhere", spec)
    for mode, (_, reports) in two_ranks.items():
        resumed = report[mode]
        assert resumed["first"] == pytest.approx(reports[0]["saved_forward"], rel=REL, abs=ABS)
        assert resumed["after"] < resumed["first"]
    # A changed byte in a shard is found on load (any world size): refused, the session
    # unusable until a load_state succeeds.
    assert "damaged" in report["damaged"]
    assert report["broken"].startswith("load_state failed midway")


def _damaged_copy(checkpoint: Path, copy: Path) -> Path:
    """The checkpoint with one byte of a weight changed where its shard file stores it.

    DCP's index gives each shard's place in its file (a ``torch.save`` record, whose padding and
    headers a reader may skip); the byte changed is one of the tensor's own."""
    shutil.copytree(checkpoint, copy)
    storage = dcp.FileSystemReader(copy).read_metadata().storage_data
    index, where = max(storage.items(), key=lambda item: item[1].length)
    shard = copy / where.relative_path
    data = bytearray(shard.read_bytes())
    record = bytes(data[where.offset : where.offset + where.length])
    values = torch.load(io.BytesIO(record), weights_only=True).numpy().tobytes()
    start = where.offset + record.index(values)
    data[start + len(values) // 2] ^= 0x10
    shard.write_bytes(bytes(data))
    assert index.fqn.startswith("model.")  # a weight, read straight into the live shard
    return copy


@pytest.mark.slow
def test_one_process_refuses_a_sharded_checkpoint_by_its_format(two_ranks, llama_config) -> None:
    spec, _ = two_ranks["full"]
    session = TrainingSession(llama_config(model=spec["model"]), max_steps=workers.MAX_STEPS)
    with pytest.raises(InvalidArgument, match=r"not a trainwire\.checkpoint/v1 checkpoint"):
        session.load_state(Path(spec["out"]) / "checkpoint")


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_the_sharded_export_loads_and_gives_the_sharded_logprobs(two_ranks, mode) -> None:
    spec, reports = two_ranks[mode]
    export = Path(spec["out"]) / "export"
    if spec["lora"]:
        base = AutoModelForCausalLM.from_pretrained(spec["model"], local_files_only=True)
        model = PeftModel.from_pretrained(base, export).eval()
    else:
        model = AutoModelForCausalLM.from_pretrained(export, local_files_only=True).eval()
    examples = workers.token_examples()
    batch = encode_token_batch(
        examples, vocab_size=10**6, max_length=64, pad_id=0, device=torch.device("cpu")
    )
    with torch.no_grad():
        logp = batch.split(target_logprobs(model, batch)[batch.mask])
    _close(logp, reports[0]["export_logprobs"])


@pytest.mark.slow
@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_gradient_checkpointing_on_two_ranks_gives_the_bits_of_the_plain_run(two_ranks, mode):
    """Non-reentrant recomputation under FSDP2 gathers each layer's weights again for the
    backward and recomputes the same activations (dropout's masks from the same RNG state), so
    every gradient, and so the whole state, is the plain run's bit for bit."""
    _, reports = two_ranks[mode]
    assert reports[0]["checkpointed_digest"] == reports[0]["digests"][0]
