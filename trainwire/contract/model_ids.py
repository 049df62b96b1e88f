"""A Tinker model id and the trainwire run that trains it, for both sides.

The SDK prints a model id (``tw-<hex>[.<tenant>]:train:<n>``); the server names the model's run
after it with the colons run ids cannot hold replaced. An operator who has only what the SDK
printed closes or lists the run by it (``trainwire close``), so the client side must name the
run exactly as the server does.
"""

from __future__ import annotations


def run_id_for(model_id: str) -> str:
    """The trainwire run id of an SDK model id (run ids take no colons); a run id is itself."""
    return model_id.replace(":", "-")
