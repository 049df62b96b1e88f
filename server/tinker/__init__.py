"""The Tinker SDK front (``pip install 'trainwire[tinker]'``): the part of Tinker's HTTP API the
official SDK needs, served on the same session host, scheduler and journal as the gRPC service.

Modules, one job each: ``app`` (the HTTP routes), ``training_routes`` and ``sampling_routes``
(decode, call the host's operation table, encode), ``codec`` and ``sample_codec`` (SDK wire
types), ``model_table`` (the open models: which run each of the SDK's models is) with
``model`` (create_model's config), ``sampling_sessions`` (which weights a sampling client
reads), ``auth`` (the ``tml-`` key), ``limits`` (body bounds), ``connections``
(bounded connections), ``front`` (the parts the routes use), ``startup`` (building them,
reading back what the service's intake recorded) and ``listener`` (uvicorn). Ordering, the
request store and the results the SDK polls are the service's (``service.intake``).
"""
