"""``create_kv_connector``: the one place a connector is chosen by name."""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

from dsv3serve.kvcache.pool import MLAKVPool
from kv_transfer.base import KVConnector

__all__ = ["CONNECTORS", "create_kv_connector"]

# name -> (module, class); modules are imported on demand (nixl only where installed)
_CONNECTORS: tuple[tuple[str, str, str], ...] = (
    ("shm", "kv_transfer.shm", "ShmConnector"),
    ("torch_dist", "kv_transfer.torch_dist", "TorchDistConnector"),
    ("nixl", "kv_transfer.nixl", "NixlConnector"),
)
CONNECTORS: tuple[str, ...] = tuple(name for name, _, _ in _CONNECTORS)


def _nixl_installed() -> bool:
    return importlib.util.find_spec("nixl") is not None


def create_kv_connector(name: str, pool: MLAKVPool, **options: Any) -> KVConnector:
    """The connector ``name`` (one of :data:`CONNECTORS`) over ``pool``.

    Raises ValueError for an unknown name or option, ImportError for ``nixl`` where the
    nixl package is not installed.
    """
    entry = next((e for e in _CONNECTORS if e[0] == name), None)
    if entry is None:
        raise ValueError(f"unknown KV connector {name!r}; valid names: {', '.join(CONNECTORS)}")
    if name == "nixl" and not _nixl_installed():
        others = ", ".join(n for n in CONNECTORS if n != "nixl")
        raise ImportError(
            f"KV connector 'nixl' needs the nixl package, which is not installed "
            f"(pip install nixl); connectors that work without it: {others}"
        )
    _, module, cls_name = entry
    cls: type[KVConnector] = getattr(importlib.import_module(module), cls_name)
    return cls(pool, **options)
