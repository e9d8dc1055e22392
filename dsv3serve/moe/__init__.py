"""MoE: router gate, expert weights and compute backends; choose with :func:`create_moe_backend`."""

from __future__ import annotations

from dsv3serve.moe.base import MoEBackend

MOE_BACKENDS = ("torch", "triton")


def moe_backend_class(name: str) -> type[MoEBackend]:
    """The class ``create_moe_backend(name)`` builds; its class attributes answer capability
    questions before a backend exists (``packs_shared_expert``, ``route``)."""
    if name == "torch":
        from dsv3serve.moe.ref import TorchRefMoE

        return TorchRefMoE
    if name == "triton":
        from dsv3serve.moe.triton_moe import TritonMoE

        return TritonMoE
    raise ValueError(f"moe backend {name!r} unknown; supported: {list(MOE_BACKENDS)}")


def create_moe_backend(name: str, act_quant: bool = True) -> MoEBackend:
    """Build the named MoE backend; raises ValueError naming the supported ones.

    ``triton`` runs the fused kernels on CUDA tensors and the torch reference elsewhere.
    """
    return moe_backend_class(name)(act_quant)
