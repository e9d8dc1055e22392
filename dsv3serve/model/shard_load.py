"""Read one rank's slices of a safetensors checkpoint, one tensor at a time.

The checkpoint is described from the files' headers alone (names, dtypes, full shapes),
the rank's part is :func:`~dsv3serve.parallel.shard_tensors.local_tensors` of that, and
only then is data read: a split tensor through ``safe_open(...).get_slice(name)[index]``
(only its rows / columns are copied out of the memory map), a whole tensor through
``get_tensor``; tensors the rank does not hold are never touched.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from itertools import groupby
from pathlib import Path

import torch
from safetensors import safe_open

from dsv3serve.parallel.shard_tensors import LocalTensor, TensorInfo

HEADER_LIMIT = 100 << 20  # safetensors' own bound on the JSON header


def read_header(file: Path) -> dict[str, TensorInfo]:
    """``{name: TensorInfo}`` of one safetensors file, in data order, without its data."""
    with file.open("rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        if size > HEADER_LIMIT:
            raise ValueError(f"{file}: header of {size} bytes, expected at most {HEADER_LIMIT}")
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    entries = sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0])
    return {n: TensorInfo(tuple(e["shape"]), e["dtype"], file.name) for n, e in entries}


def read_index(files: list[Path]) -> dict[str, TensorInfo]:
    """Every tensor of the checkpoint's ``files``; a name in two files is refused."""
    infos: dict[str, TensorInfo] = {}
    for file in files:
        for name, info in read_header(file).items():
            if name in infos:
                raise ValueError(f"{name} is in both {infos[name].file} and {file.name}")
            infos[name] = info
    return infos


def iter_local(model_dir: Path, tensors: list[LocalTensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, local slice)`` for ``tensors``, file by file, one at a time.

    A split tensor is read with ``get_slice(name)[index]``, so only its slice leaves the
    memory map; the caller copies it into the model before the next one is read.
    """
    for file, group in groupby(tensors, key=lambda t: t.info.file):
        with safe_open(str(model_dir / file), framework="pt", device="cpu") as handle:
            for t in group:
                yield t.name, _read(handle, t)


def _read(handle: object, t: LocalTensor) -> torch.Tensor:
    index = t.placement.index(t.info.shape)
    if index is None:
        return handle.get_tensor(t.name)  # type: ignore[attr-defined]
    part = handle.get_slice(t.name)[index]  # type: ignore[attr-defined]
    return _pad_to(part, t.local_shape)


def _pad_to(part: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """``part`` zero-padded at the end to ``shape`` (a padded split's last ranks)."""
    if tuple(part.shape) == tuple(shape):
        return part
    out = torch.zeros(shape, dtype=part.dtype)
    out[tuple(slice(0, n) for n in part.shape)] = part
    return out
