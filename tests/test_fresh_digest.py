"""Why ``tests/fresh_state.py`` exists: the session's own digest is cached per state version, so a
change that bumps no version (what a faulty forward, sample or refusal would do) leaves it as it
was; only a digest hashed afresh sees the change."""

from __future__ import annotations

import torch
from fresh_state import fresh_digest, fresh_info

from trainwire.server.engine.session import TrainingSession
from trainwire.server.engine.session.rng import RngState
from trainwire.testing import tiny_text_examples


def test_a_weight_changed_in_place_shows_in_the_fresh_digest_and_not_in_the_cached_one(
    llama_config,
) -> None:
    session = TrainingSession(llama_config(), device="cpu")
    cached = session.state_digest()
    assert fresh_digest(session) == cached  # nothing changed: the two agree

    with torch.no_grad():
        next(session.model.parameters()).add_(1e-3)  # no operation, no version bump
    assert session.state_digest() == cached  # the cache still answers the old state
    changed = fresh_digest(session)
    assert changed != cached

    session._guard.rng = RngState.seeded(99)  # the random state too, again with no bump
    assert session.state_digest() == changed
    assert fresh_digest(session) != changed


def test_the_fresh_info_of_a_host_sees_what_its_cached_info_does_not(host) -> None:
    before = host.info()
    assert fresh_info(host) == before
    session = host.session
    session.forward_backward(tiny_text_examples(2))  # a pending gradient, bypassing the host
    with_gradient = host.info().state_digest
    assert fresh_info(host).state_digest == with_gradient != before.state_digest
    for gradient in session.pending_gradients().values():
        gradient.mul_(2)  # in place: the version stays
    assert host.info().state_digest == with_gradient
    assert fresh_info(host).state_digest != with_gradient
