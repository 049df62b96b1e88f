"""Sample requests of mixed shapes, and ways to watch and hold the host while they queue, for the
batched-sampling tests."""

from __future__ import annotations

import threading

import torch

from trainwire.server.engine.session import TrainingSession
from trainwire.server.service.host import SessionHost
from trainwire.server.service.requests import SampleRequest

SEED_PROMPT = 7


def prompts(vocab: int) -> list[list[int]]:
    """Prompts of lengths 3, 5, 5 and 9 (two of one length: they share tiles)."""
    generator = torch.Generator().manual_seed(SEED_PROMPT)
    return [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in (3, 5, 5, 9)]


def mixed_requests(vocab: int) -> list[SampleRequest]:
    """Other prompt lengths, seeds, counts and max_tokens; the last stops early on most ids."""
    first, second, third, fourth = prompts(vocab)
    early = tuple(range(3, vocab, 3))
    return [
        SampleRequest(first, max_tokens=9, num_samples=3, seed=1),
        SampleRequest(second, max_tokens=4, num_samples=2, seed=2, top_p=0.9),
        SampleRequest(third, max_tokens=12, num_samples=5, seed=3, top_k=20, prompt_logprobs=True),
        SampleRequest(fourth, max_tokens=10, num_samples=4, seed=4, stop_tokens=early),
        SampleRequest(second, max_tokens=6, num_samples=1, seed=5, temperature=0),
    ]


def spy_batches(monkeypatch) -> list[int]:
    """How many requests each batch decoded (those joining included)."""
    sizes: list[int] = []
    inner = TrainingSession.sample_many

    def counted(session, selected, requests, join):
        # Noted as the batch starts: its first answers may reach their callers before it ends.
        index = len(sizes)
        sizes.append(len(requests))

        def counting_join():
            joined = join()
            sizes[index] += len(joined)
            return joined

        inner(session, selected, requests, counting_join)

    monkeypatch.setattr(TrainingSession, "sample_many", counted)
    return sizes


def held_executor(host: SessionHost, monkeypatch) -> tuple[threading.Event, threading.Event]:
    """A tokenize call that holds the executor until ``release`` is set (so requests queue)."""
    started, release = threading.Event(), threading.Event()
    session = host.session
    inner = session.tokenize

    def held(*args, **kwargs):
        started.set()
        release.wait(60)
        return inner(*args, **kwargs)

    monkeypatch.setattr(session, "tokenize", held)
    return started, release
