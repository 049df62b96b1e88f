"""Driving a manifest's run against servers: the ``Controller`` and its durable cursor, the
replay's remote backend, the dispatcher over a pool of servers, and the live progress view."""
