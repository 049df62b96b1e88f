"""TrainingSession digests: every state-changing operation moves the digest, nothing else does,
and sessions keep their own RNG, so sessions driven alike agree however they are interleaved
(between operations, with a third party drawing from the global generators, or on two threads).
"""

from __future__ import annotations

import torch
from fresh_state import fresh_digest

from trainwire.server.engine.session import TrainingSession
from trainwire.server.engine.session.rng import RngState
from trainwire.testing import tiny_text_examples

TEXTS = tiny_text_examples(6)


def test_state_digest_changes_after_every_state_changing_operation(
    llama_config, small_lora, tiny_llama, tmp_path
) -> None:
    session = TrainingSession(llama_config(lora=small_lora), max_steps=4)
    digests = [session.state_digest()]
    session.forward_backward(TEXTS[:3])
    digests.append(session.state_digest())
    session.forward_backward(TEXTS[3:])
    digests.append(session.state_digest())
    session.optim_step()
    digests.append(session.state_digest())
    session.forward_backward(TEXTS[:3])
    digests.append(session.state_digest())
    session.optim_step()
    digests.append(session.state_digest())
    session.load_weights(tiny_llama)  # the adapters keep their trained values, base unchanged
    assert fresh_digest(session) == digests[-1]
    assert len(set(digests)) == len(digests)

    # Operations that change no state leave the digest alone.
    session.forward(TEXTS)
    session.save_state(tmp_path / "checkpoint")
    session.export_weights(tmp_path / "export")
    assert fresh_digest(session) == digests[-1]


def test_digest_covers_the_session_rng(llama_config, small_lora) -> None:
    a = TrainingSession(llama_config(lora=small_lora))
    b = TrainingSession(llama_config(lora=small_lora))
    assert a.state_digest() == b.state_digest()
    b._guard.rng = RngState.seeded(123)
    b._guard.changed()
    assert a.state_digest() != b.state_digest()


def run_and_record(session: TrainingSession, operations: list) -> list[str]:
    digests = []
    for operation in operations:
        operation(session)
        digests.append(fresh_digest(session))
    return digests


OPERATIONS = [
    lambda s: s.forward_backward(TEXTS[:3]),
    lambda s: s.forward_backward(TEXTS[3:]),
    lambda s: s.optim_step(),
    lambda s: s.forward(TEXTS),
    lambda s: s.forward_backward(TEXTS[1:4]),
    lambda s: s.optim_step(),
]


def test_sessions_driven_identically_reach_equal_digests(llama_config, small_lora) -> None:
    config = llama_config(lora=small_lora)
    first = run_and_record(TrainingSession(config, max_steps=2), OPERATIONS)
    second = run_and_record(TrainingSession(config, max_steps=2), OPERATIONS)
    assert first == second
    assert len(set(first)) == len(first) - 1  # forward changes nothing


def test_interleaved_sessions_give_the_digests_each_gives_alone(llama_config, small_lora) -> None:
    config = llama_config(lora=small_lora)
    alone = run_and_record(TrainingSession(config, max_steps=2), OPERATIONS)
    other_config = llama_config(lora=small_lora, seed=7)
    other_alone = run_and_record(TrainingSession(other_config, max_steps=2), OPERATIONS)

    # A third party drawing from the global generators between operations changes nothing.
    torch.manual_seed(99)
    sessions = [TrainingSession(config, max_steps=2), TrainingSession(other_config, max_steps=2)]
    together: list[list[str]] = [[], []]
    for operation in OPERATIONS:
        for k, session in enumerate(sessions):
            torch.rand(3)
            global_state = torch.get_rng_state()
            operation(session)
            assert torch.equal(torch.get_rng_state(), global_state), "the global RNG moved"
            together[k].append(fresh_digest(session))
    assert together == [alone, other_alone]


def test_sessions_on_two_threads_keep_their_own_bits(llama_config, small_lora) -> None:
    import threading

    def drive(session, steps=6):
        for i in range(steps):
            session.forward_backward(TEXTS[i % 4 : i % 4 + 3])
            session.optim_step()
        return session.state_digest()

    configs = [llama_config(lora=small_lora, seed=seed, max_length=64) for seed in (1, 2)]
    alone = [drive(TrainingSession(config, max_steps=6)) for config in configs]
    sessions = [TrainingSession(config, max_steps=6) for config in configs]
    digests: dict[int, str] = {}
    threads = [
        threading.Thread(target=lambda i=i: digests.update({i: drive(sessions[i])}))
        for i in range(2)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [digests[0], digests[1]] == alone
