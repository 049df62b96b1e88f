"""The server's tunable defaults (``trainwire serve --set KEY=VALUE`` overrides them).

Torch-free, so ``serve`` checks its arguments against them before the seconds torch takes to
load: a mistake on the command line is one line at once.
"""

DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
DEFAULT_MAX_WORKERS = 32
DEFAULT_STOP_GRACE_S = 60.0
