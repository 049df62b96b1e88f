"""The Tinker SDK front (``pip install 'trainwire[tinker]'``): the part of Tinker's HTTP API the
official SDK needs, served on the same session host, executor and journal as the gRPC service.

Modules, one job each: ``app`` (routes), ``auth`` (the ``tml-`` key), ``front`` (the SDK's calls
on the host), ``model`` (create_model's config), ``codec`` (SDK wire types), ``ordering``
(seq_id order), ``futures`` (polls), ``samplers`` (sampling sessions), ``losses`` (per-token
losses), ``listener`` (uvicorn).
"""
