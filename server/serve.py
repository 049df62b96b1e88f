"""Deprecated: the gRPC server is ``trainwire.server.grpc_server``; ``serve`` is the function
``trainwire.server.serve``.

Kept only while tests/test_service_api.py still runs ``import trainwire.server.serve``: importing
this module would otherwise rebind the package's ``serve`` to a module, so it puts the function
in its place. Remove it once nothing imports ``trainwire.server.serve`` as a module.
"""

import sys

from trainwire.server import serve

sys.modules[__name__] = serve  # type: ignore[assignment]
