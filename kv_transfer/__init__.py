"""Moving MLA KV pages from a prefill engine to a decode engine (pull protocol).

The prefill side ``publish``-es a prompt's pages and gets a JSON-safe :class:`KVHandle`;
the router carries it to the decode side, which ``receive``-s into reserved pages; the
prefill side then ``release``-s. Connectors: ``shm`` (same host), ``torch_dist`` (gloo /
NCCL point-to-point), ``nixl`` and ``mooncake`` (optional one-sided READs, tested on CPU
only). Depends on ``dsv3serve.kvcache`` only.

Names are resolved lazily, so importing ``kv_transfer.handle`` (as the router does) loads
no torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "KVConnector": "kv_transfer.base",
    "CONNECTORS": "kv_transfer.factory",
    "create_kv_connector": "kv_transfer.factory",
    "KVHandle": "kv_transfer.handle",
    "TransferError": "kv_transfer.handle",
    "TransferStats": "kv_transfer.handle",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'kv_transfer' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
