"""``create_kv_connector``: the one place a connector is chosen by name."""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

from dsv3serve.kvcache.pool import MLAKVPool
from kv_transfer.base import KVConnector

__all__ = ["CONNECTORS", "OPTIONAL", "create_kv_connector", "installed"]

# name -> (module, class); modules are imported on demand (nixl, mooncake only where installed)
_CONNECTORS: tuple[tuple[str, str, str], ...] = (
    ("shm", "kv_transfer.shm", "ShmConnector"),
    ("torch_dist", "kv_transfer.torch_dist", "TorchDistConnector"),
    ("nixl", "kv_transfer.nixl", "NixlConnector"),
    ("mooncake", "kv_transfer.mooncake", "MooncakeConnector"),
)
CONNECTORS: tuple[str, ...] = tuple(name for name, _, _ in _CONNECTORS)
# optional connectors: name -> (module that must import, what to pip install)
OPTIONAL: dict[str, tuple[str, str]] = {
    "nixl": ("nixl", "nixl"),
    "mooncake": ("mooncake.engine", "mooncake-transfer-engine"),
}


def installed(name: str) -> bool:
    """Whether the optional package connector ``name`` needs is importable (True if none)."""
    if name not in OPTIONAL:
        return True
    top = OPTIONAL[name][0].split(".")[0]
    return importlib.util.find_spec(top) is not None


def create_kv_connector(name: str, pool: MLAKVPool, **options: Any) -> KVConnector:
    """The connector ``name`` (one of :data:`CONNECTORS`) over ``pool``.

    Raises ValueError for an unknown name or option, ImportError for ``nixl`` or
    ``mooncake`` where its package is not installed.
    """
    entry = next((e for e in _CONNECTORS if e[0] == name), None)
    if entry is None:
        raise ValueError(f"unknown KV connector {name!r}; valid names: {', '.join(CONNECTORS)}")
    if not installed(name):
        package = OPTIONAL[name][1]
        others = ", ".join(n for n in CONNECTORS if n not in OPTIONAL)
        raise ImportError(
            f"KV connector {name!r} needs the {package} package, which is not installed "
            f"(pip install {package}); connectors that work without it: {others}"
        )
    _, module, cls_name = entry
    cls: type[KVConnector] = getattr(importlib.import_module(module), cls_name)
    return cls(pool, **options)
