"""Talking to a server's session: ``SessionClient`` (one gRPC connection), its retries, errors,
ordered pipelining of keyed calls, export downloads, and custom losses computed on this side."""
