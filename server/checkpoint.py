"""Deprecated alias of ``trainwire.server.session_checkpoint``, where the format now lives.

Kept only for ``trainwire.inspection``'s import of ``SESSION_FILE``; remove it once that imports
from ``trainwire.server.session_checkpoint``.
"""

from trainwire.server.session_checkpoint import SESSION_FILE

__all__ = ["SESSION_FILE"]
