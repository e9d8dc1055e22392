"""Moving MLA KV pages from a prefill engine to a decode engine (pull protocol).

The prefill side ``publish``-es a prompt's pages and gets a JSON-safe :class:`KVHandle`;
the router carries it to the decode side, which ``receive``-s into reserved pages; the
prefill side then ``release``-s. Connectors: ``shm`` (same host), ``torch_dist`` (gloo /
NCCL point-to-point), ``nixl`` (optional, untested). Depends on ``dsv3serve.kvcache`` only.
"""

from kv_transfer.base import KVConnector
from kv_transfer.factory import CONNECTORS, create_kv_connector
from kv_transfer.handle import KVHandle, TransferError, TransferStats

__all__ = [
    "CONNECTORS",
    "KVConnector",
    "KVHandle",
    "TransferError",
    "TransferStats",
    "create_kv_connector",
]
