"""A plan: the microbatches, updates and evaluations of a run, fixed before it starts (``plan``),
the manifest files it is read from and written to (``manifest``) and the ``--set`` overrides of
its config (``overrides``)."""
