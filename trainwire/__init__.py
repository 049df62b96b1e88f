"""trainwire: a remote training session over gRPC with exactly-once, crash-proof replay.

``trainwire.client`` plans and drives runs (no torch); ``trainwire.server`` owns the session.
"""

__version__ = "0.1.0"
