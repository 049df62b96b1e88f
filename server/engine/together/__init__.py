"""Several LoRA sessions on one shared base, computed in one pass over it.

``run_together`` (``run``) runs several sessions' ``forward_backward`` (or ``forward``) requests
as one pass: the base once over every request's rows, each session's adapter, loss and gradients
from its own rows only, each session ending exactly as it ends alone. ``compatible``
(``compatibility``) says whether requests may run so, or why not; ``row_invariance`` says
whether this device's kernels allow it at all. ``row_blocks`` holds the pass's one trick: each
row block of the stacked rows under its own session's adapter.

``sampling`` decodes several sessions' samples as one batch the same way: at each decode step
the base once over every session's tiles of one length, each tile under its own session's
adapter (``sample_together``; ``sessions_problem`` and ``request_problem`` say when not).

The caller (the service's scheduler) takes the requests ready at once on sessions of one base,
splits them with ``group_together(requests, row_invariance(model))`` (or asks ``compatible``
of a set it chose), runs each group of two or more with ``run_together`` and each other request
alone; ``optim_step`` stays per session.
"""

from trainwire.server.engine.together.compatibility import compatible, group_together
from trainwire.server.engine.together.row_invariance import RowInvariance, row_invariance
from trainwire.server.engine.together.run import Request, Result, run_together

__all__ = [
    "Request",
    "Result",
    "RowInvariance",
    "compatible",
    "group_together",
    "row_invariance",
    "run_together",
]
