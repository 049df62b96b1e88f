"""One session across several processes: the ranks, what rank 0 sends them, and the supervisor
that restarts them together (``docs/SHARDING.md``)."""
