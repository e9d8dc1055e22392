"""Measured tables of where DeepGEMM beats the GEMM that would run without it, per GPU.

A table is one JSON file per GPU in ``dsv3serve/kernels/configs/``, named
``deepgemm,device=NVIDIA_H200.json`` (the device as ``torch.cuda.get_device_name`` with
spaces and slashes turned into underscores), written by ``dsv3serve bench kernels --only
deepgemm --write-deepgemm-table``. It holds what was timed, not a decision::

    {"environment": {"gpu": ..., "deep_gemm": ..., "date": ...},
     "dense": {"N=7168,K=16384": {"1024": {"deepgemm_us": 61.0, "baseline": "cublas",
                                           "baseline_us": 70.2}, ...}, ...},
     "contiguous": {"E=256,N=2048,K=7168,top_k=8": {"<tokens>": {...}}},
     "masked": {"E=32,N=2048,K=7168,M=1024": {"<tokens per rank>": {...}}}}

``baseline`` is the backend the ``auto`` dispatch runs without DeepGEMM (Triton or cuBLAS
for a dense GEMM, the fused Triton MoE for the grouped ones). The rule (:func:`wins`): at
M, DeepGEMM is picked only if the measured points nearest M on both sides (M itself when
measured) were each at least :data:`MIN_SPEEDUP` times faster than the baseline; outside
the measured range, or for a shape or GPU with no table, it is not.
"""

from __future__ import annotations

import bisect
import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CONFIG_DIR = Path(__file__).parent / "configs"
MIN_SPEEDUP = 1.05
SECTIONS = ("dense", "contiguous", "masked")


def normalize_device_name(device: str) -> str:
    """``"NVIDIA H200"`` -> ``"NVIDIA_H200"``: runs of spaces and slashes become one underscore
    (as vLLM names its tables, e.g. ``NVIDIA_H100_80GB_HBM3``, ``NVIDIA_A100-SXM4-80GB``)."""
    return "_".join(device.replace("/", " ").split())


def table_path(device: str, config_dir: Path = CONFIG_DIR) -> Path:
    return config_dir / f"deepgemm,device={normalize_device_name(device)}.json"


def dense_key(n: int, k: int) -> str:
    return f"N={n},K={k}"


@dataclass(frozen=True)
class Measured:
    """One timed point: DeepGEMM and the baseline at ``m`` rows (tokens for the MoE)."""

    m: int
    deepgemm_us: float
    baseline: str
    baseline_us: float

    @property
    def speedup(self) -> float:
        return self.baseline_us / self.deepgemm_us

    def to_json(self) -> dict[str, str | float]:
        return {"deepgemm_us": self.deepgemm_us, "baseline": self.baseline,
                "baseline_us": self.baseline_us}  # fmt: skip


def wins(points: tuple[Measured, ...], m: int) -> bool:
    """Whether DeepGEMM runs at ``m``: the measured points nearest ``m`` below and above (or
    ``m`` itself) both reached :data:`MIN_SPEEDUP`. ``points`` sorted by ``m``."""
    ms = [p.m for p in points]
    hi = bisect.bisect_left(ms, m)
    if hi == len(ms):
        return False
    if ms[hi] == m:
        return points[hi].speedup >= MIN_SPEEDUP
    return hi > 0 and min(points[hi - 1].speedup, points[hi].speedup) >= MIN_SPEEDUP


def change_points(points: tuple[Measured, ...]) -> set[int]:
    """Every M at which :func:`wins` over ``points`` may change value."""
    return {p.m for p in points} | {p.m + 1 for p in points}


@dataclass(frozen=True)
class DeepGemmTable:
    """One GPU's measurements, by section and shape key, each sorted by M."""

    device: str
    sections: Mapping[str, Mapping[str, tuple[Measured, ...]]]
    environment: Mapping[str, object]

    def points(self, section: str, key: str) -> tuple[Measured, ...]:
        return self.sections.get(section, {}).get(key, ())

    def dense_wins(self, m: int, n: int, k: int) -> bool:
        """Whether DeepGEMM was measured faster enough for an M x N x K dense GEMM."""
        return wins(self.points("dense", dense_key(n, k)), m)


def _points(raw: Mapping[str, Mapping[str, str | float]]) -> tuple[Measured, ...]:
    rows = [Measured(int(m), float(r["deepgemm_us"]), str(r["baseline"]),
                     float(r["baseline_us"])) for m, r in raw.items()]  # fmt: skip
    return tuple(sorted(rows, key=lambda p: p.m))


def parse_table(device: str, data: Mapping[str, Any]) -> DeepGemmTable:
    unknown = set(data) - {*SECTIONS, "environment"}
    if unknown:
        raise ValueError(f"expected sections {SECTIONS} and environment, found {sorted(unknown)}")
    sections = {s: {key: _points(pts) for key, pts in data.get(s, {}).items()} for s in SECTIONS}
    return DeepGemmTable(normalize_device_name(device), sections, data.get("environment", {}))


@functools.cache
def load_table(device: str, config_dir: Path = CONFIG_DIR) -> DeepGemmTable | None:
    """The shipped table of ``device`` (a CUDA device name), or None when it has none."""
    path = table_path(device, config_dir)
    if not path.is_file():
        return None
    return parse_table(device, json.loads(path.read_text()))


def shipped_devices(config_dir: Path = CONFIG_DIR) -> list[str]:
    """The GPUs that have a table (normalised names)."""
    return sorted(p.stem.split("device=", 1)[1] for p in config_dir.glob("deepgemm,device=*.json"))


def write_section(
    path: Path,
    section: str,
    points: Mapping[str, list[Measured]],
    environment: Mapping[str, object],
) -> None:
    """Replace ``section``'s entries for the shape keys in ``points`` (other entries and
    sections kept) and the file's environment."""
    if section not in SECTIONS:
        raise ValueError(f"expected a section of {SECTIONS}, got {section!r}")
    data = json.loads(path.read_text()) if path.is_file() else {}
    data["environment"] = dict(environment)
    part = data.setdefault(section, {})
    for key, rows in points.items():
        part[key] = {str(p.m): p.to_json() for p in sorted(rows, key=lambda p: p.m)}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    load_table.cache_clear()
