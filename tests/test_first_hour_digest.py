"""A session's digest does not depend on what others do to the global streams it never uses.

The first ``make demo`` on a fresh clone once printed another digest than every later run: only
the Python ``random`` state in the checkpoint differed, because something in the process drew
from the global stream while an operation held the session's state installed, and the session
took that state back as its own. The session draws from torch's generators only; a draw from
Python's or NumPy's global stream inside an operation (a library's first-run path, another
thread) must leave its bits alone.
"""

from __future__ import annotations

import random
import threading

import numpy as np
from fresh_state import fresh_digest

from trainwire.client import InputExample
from trainwire.server.engine.session import TrainingSession

TEXTS = [InputExample(f"the first hour, example {i}") for i in range(4)]


def train(session: TrainingSession) -> str:
    session.forward_backward(TEXTS[:2])
    session.forward_backward(TEXTS[2:])
    session.optim_step()
    session.forward(TEXTS)
    return fresh_digest(session)


def test_a_draw_from_the_global_streams_inside_an_operation_leaves_the_digest_alone(
    llama_config, small_lora
) -> None:
    config = llama_config(lora=small_lora, lr_scheduler="constant")  # dropout: torch draws too
    plain = TrainingSession(config)
    drawn = TrainingSession(config)
    draws: list[tuple[float, float]] = []

    def library_first_call(module, args) -> None:
        if not draws:  # once, as a library's first-run path does
            draws.append((random.random(), float(np.random.rand())))

    drawn.model.register_forward_pre_hook(library_first_call)
    assert train(drawn) == train(plain)
    assert draws, "the hook never ran inside an operation"


def test_another_thread_drawing_during_an_operation_leaves_the_digest_alone(
    llama_config, small_lora
) -> None:
    config = llama_config(lora=small_lora, lr_scheduler="constant")
    plain = TrainingSession(config)
    drawn = TrainingSession(config)
    inside, done = threading.Event(), threading.Event()

    def other_thread() -> None:
        inside.wait()
        random.random()  # the operation holds the session's state installed right now
        np.random.rand()
        done.set()

    def wait_for_the_other_thread(module, args) -> None:
        if not inside.is_set():
            inside.set()
            done.wait()

    drawn.model.register_forward_pre_hook(wait_for_the_other_thread)
    thread = threading.Thread(target=other_thread)
    thread.start()
    try:
        assert train(drawn) == train(plain)
    finally:
        inside.set()
        thread.join()
    assert done.is_set()
