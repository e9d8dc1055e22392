"""The MTP draft state between an engine's tensors and the wire (``DraftHandoff``).

Bytes are the tensor's own (C order, little-endian), so the round trip is bit-exact for
every value, NaN payloads and -0.0 included. torch lives here, never in the protocol.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping
from types import MappingProxyType

import torch

from dsv3serve.engine.speculative.loop import DraftState
from workers.protocol import DraftHandoff, WireDType

_DTYPES: Mapping[WireDType, torch.dtype] = MappingProxyType(
    {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
)
_NAMES: Mapping[torch.dtype, WireDType] = MappingProxyType({d: name for name, d in _DTYPES.items()})


class DraftMismatchError(ValueError):
    """A draft state that does not fit this engine (another model's hidden size)."""


def _check_byte_order() -> None:
    if sys.byteorder != "little":
        raise RuntimeError(f"the draft wire format is little-endian; this host is {sys.byteorder}")


def tensor_to_bytes(t: torch.Tensor) -> bytes:
    """The raw bytes of ``t`` (any device; copied to the CPU, C order)."""
    _check_byte_order()
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes()


def tensor_from_bytes(
    data: bytes, dtype: torch.dtype, shape: list[int], device: torch.device | str = "cpu"
) -> torch.Tensor:
    """The tensor whose raw bytes are ``data``; raises ValueError on a size mismatch."""
    _check_byte_order()
    expected = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if len(data) != expected:
        raise ValueError(f"expected {expected} bytes for {dtype} {shape}, got {len(data)}")
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return raw.view(dtype).reshape(shape).to(device)


def draft_to_wire(state: DraftState) -> DraftHandoff:
    """The wire form of an engine's draft state (``KVExport.draft``)."""
    hidden = state.hidden
    if hidden.dtype not in _NAMES:
        raise ValueError(
            f"draft hidden dtype: found {hidden.dtype}, expected one of {sorted(_DTYPES)}"
        )
    return DraftHandoff(
        token=state.token,
        dtype=_NAMES[hidden.dtype],
        shape=list(hidden.shape),
        hidden=tensor_to_bytes(hidden),
    )


def draft_from_wire(
    msg: DraftHandoff,
    num_tokens: int,
    hidden_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> DraftState:
    """The engine's draft state for a sequence of ``num_tokens`` (prompt + first token).

    The hidden state comes back bit-exact, then is cast to this engine's ``dtype`` on
    ``device``. Raises :class:`DraftMismatchError` unless its shape is ``[hidden_size]``.
    """
    if msg.shape != [hidden_size]:
        raise DraftMismatchError(
            f"draft hidden state: found shape {msg.shape}, expected [{hidden_size}] (this "
            "decode engine's hidden_size): prefill and decode must serve the same model"
        )
    hidden = tensor_from_bytes(msg.hidden, _DTYPES[msg.dtype], msg.shape, device)
    return DraftState(num_tokens, msg.token, hidden.to(dtype))
