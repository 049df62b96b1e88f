"""The gRPC transport: the servicer (decode, call the host's operation table, encode) and the
gRPC listener with its health, reflection, token check and TLS."""
