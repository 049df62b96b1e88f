"""The service around one engine: the session host and its one table of keyed operations, the
scheduler that orders them, the durable journal, recovery after a restart, the state directory
and the request limits.

Transports (``trainwire.server.grpc``, ``trainwire.server.tinker``) decode a request, call the
host's operation table and encode the outcome; they never touch the engine themselves.
"""
