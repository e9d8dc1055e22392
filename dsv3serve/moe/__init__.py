"""MoE: router gate, expert weights and compute backends; choose with :func:`create_moe_backend`."""

from __future__ import annotations

from dsv3serve.moe.base import MoEBackend

MOE_BACKENDS = ("torch", "triton")


def create_moe_backend(name: str, act_quant: bool = True) -> MoEBackend:
    """Build the named MoE backend; raises ValueError naming the supported ones.

    ``triton`` runs the fused kernels on CUDA tensors and the torch reference elsewhere.
    """
    if name == "torch":
        from dsv3serve.moe.ref import TorchRefMoE

        return TorchRefMoE(act_quant)
    if name == "triton":
        from dsv3serve.moe.triton_moe import TritonMoE

        return TritonMoE(act_quant)
    raise ValueError(f"moe backend {name!r} unknown; supported: {list(MOE_BACKENDS)}")
