"""Every bound a tenant can fill is that tenant's: the samples and the bytes of decoded
requests one tenant keeps waiting never refuse another tenant's."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
from test_tenants_bounds import ALICE, ANSWER_S, BOB, HELD_S, two_tenants
from test_tenants_tinker import API, Front
from tinker.proto import tinker_public_pb2 as pb

from trainwire.server.errors import ResourceExhausted
from trainwire.server.service import scheduler

SAMPLES_HELD = 4  # the bound of waiting samples of each tenant in the sampling test


def own_sampler(front: Front) -> str:
    """A new model of the caller's and a sampling session on a snapshot of it."""
    session = front.post("create_session", {})["session_id"]
    lora = {"base_model": "llama", "lora_config": {"rank": 4}}
    model = front.post("create_model", {"session_id": session, **lora})["model_id"]
    snapshot = {"model_id": model, "seq_id": 1, "sampling_session_seq_id": 0}
    return front.result(front.post("save_weights_for_sampler", snapshot))["sampling_session_id"]


def sample_body(sampler: str, seq_id: int) -> dict[str, Any]:
    return {
        "sampling_session_id": sampler,
        "seq_id": seq_id,
        "num_samples": 1,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
        "sampling_params": {"max_tokens": 2, "seed": 7},
    }


def sequences(answer: bytes) -> int:
    """How many sequences a sample's answer (the SDK's protobuf) holds."""
    return len(pb.SampleResponse.FromString(answer).sequences)


def test_the_bytes_one_account_holds_never_refuse_anothers_requests() -> None:
    """Alice's model holds its account's whole byte bound: her next call is refused, while bob's
    model and bob's samples are taken, each within bounds of bob's own."""
    running, release = threading.Event(), threading.Event()
    order = scheduler.Scheduler(max_held=2, max_bytes=250, max_total_bytes=400)

    def first() -> None:
        running.set()
        release.wait(HELD_S)

    order.start_stream("alice-model", account="alice")
    order.start_stream("bob-model", account="bob")
    assert order.submit("alice-model", 1, "a1", first, size=200)
    assert running.wait(ANSWER_S)
    assert order.submit("alice-model", 2, "a2", lambda: None, size=200)  # 400: alice's bound
    with pytest.raises(ResourceExhausted, match="this key holds 400 bytes"):
        order.check_room(100, account="alice")
    assert order.submit("bob-model", 1, "b1", lambda: None, size=150)
    order.check_room(200, account="bob")
    order.run_unordered(lambda: None, 200, account="bob")  # bob's 350
    with pytest.raises(ResourceExhausted, match="this key holds 350 bytes"):
        order.submit("bob-model", 2, "b2", lambda: None, size=100)
    release.set()
    order.release(lambda: None)


def test_one_tenants_samples_at_their_bound_never_refuse_anothers_sample(
    tmp_path: Path, model_root: Path, tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bob fills his bound of waiting samples (of his own model, the device held meanwhile) and
    is refused 429; alice's sample of her own model is taken beside them, and once the device is
    free every sample taken is answered."""
    monkeypatch.setattr(scheduler, "DEFAULT_MAX_HELD", SAMPLES_HELD)
    with two_tenants(tmp_path / "state", model_root) as handle:
        alice, bob = Front(handle, ALICE), Front(handle, BOB)
        alices, bobs = own_sampler(alice), own_sampler(bob)
        release = threading.Event()
        holder = threading.Thread(target=handle.session_host.scheduler.run, args=(release.wait,))
        holder.start()  # the device is busy: every sample taken waits
        taken, refused = [], None
        try:
            for seq_id in range(1, 5 * SAMPLES_HELD):
                answer = bob.send("POST", f"{API}/asample", json=sample_body(bobs, seq_id))
                if answer.status_code != 200:
                    refused = answer
                    break
                taken.append(answer.json())
            assert refused is not None and refused.status_code == 429, refused
            assert "samples: " in refused.json()["detail"]
            mine = alice.send("POST", f"{API}/asample", json=sample_body(alices, 1))
            assert mine.status_code == 200, mine.text
        finally:
            release.set()
            holder.join(timeout=HELD_S)
        assert sequences(alice.result(mine.json())) == 1
        assert [sequences(bob.result(future)) for future in taken] == [1] * len(taken)
