"""Several LoRA sessions on one shared base, computed in one pass over it.

``run_together`` (``run``) runs several sessions' ``forward_backward`` (or ``forward``) requests
as one pass: the base once over every request's rows, each session's adapter, loss and gradients
from its own rows only, each session ending exactly as it ends alone. ``compatible``
(``compatibility``) says whether requests may run so, or why not; ``row_invariance`` says
whether this device's kernels allow it at all. ``row_blocks`` holds the pass's one trick: each
row block of the stacked rows under its own session's adapter.

The caller (the service's scheduler) picks requests ready at once on sessions of one base,
asks ``compatible(requests, row_invariance(model))``, and runs them with ``run_together`` when it
answers None, in turns otherwise; ``optim_step`` stays per session.
"""

from trainwire.server.engine.together.compatibility import compatible
from trainwire.server.engine.together.row_invariance import RowInvariance, row_invariance
from trainwire.server.engine.together.run import Request, Result, run_together

__all__ = ["Request", "Result", "RowInvariance", "compatible", "row_invariance", "run_together"]
