"""The environment variables dsv3serve reads, in one typed place.

The project's configuration variables are read through :meth:`Settings.from_env`, and the
compile caches are exported by :func:`export_compile_caches`. The exceptions are listed in
docs/architecture.md (a CPU test switch read in ``engine/model_runner.py``; NCCL, Ray and
Serve variables set before a group or the local cluster starts). Imports no torch, so the
router may use it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path

CACHE_ENV = "DSV3SERVE_CACHE"
API_KEY_ENV = "DSV3SERVE_API_KEY"
FUSED_NORM_QUANT_ENV = "DSV3SERVE_FUSED_NORM_QUANT"
RANK_STACKS_ENV = "DSV3SERVE_RANK_STACKS_S"
FUSED_MLA_ENV = "DSV3SERVE_FUSED_MLA"
WORKER_MULTIPROC_ENV = "DSV3SERVE_WORKER_MULTIPROC_METHOD"
WORKER_MULTIPROC_METHODS = ("forkserver", "spawn")
_OFF = ("0", "false", "off", "no")
# The compile / JIT caches that make a warm start, each in its sub-folder of the cache dir:
# Triton's kernels (ours included), flashinfer's JIT modules (it appends .cache/flashinfer),
# its tvm-ffi builds, torch.compile's Inductor artefacts and DeepGEMM's JIT kernels.
COMPILE_CACHE_ENV = {
    "TRITON_CACHE_DIR": "triton",
    "FLASHINFER_WORKSPACE_BASE": "flashinfer",
    "TVM_FFI_CACHE_DIR": "tvm-ffi",
    "TORCHINDUCTOR_CACHE_DIR": "inductor",
    "DG_JIT_CACHE_DIR": "deep_gemm",
}


@dataclass(frozen=True, repr=False)
class Settings:
    """The process environment as dsv3serve sees it, read once per call of ``from_env``."""

    cache_dir: Path
    """``$DSV3SERVE_CACHE``: where the tiny checkpoints, config presets and the built-in
    tokenizer are written once and reused (default ``~/.cache/dsv3serve``)."""

    api_key: str
    """The router's API key, stripped: ``$DSV3SERVE_API_KEY``, or the variable that
    ``router.api_key_env`` names instead. Empty: unset (authentication off unless a
    variable was named, see :class:`router.api.auth.APIKeyAuth`)."""

    fused_norm_quant: bool = True
    """``$DSV3SERVE_FUSED_NORM_QUANT``: ``0``/``false``/``off``/``no`` turns off the fused
    residual add + RMSNorm + FP8 quantisation kernel in the decoder layers (the default
    :class:`dsv3serve.model.deepseek_v3.ModelOptions` reads it); on otherwise."""

    rank_stacks_s: float = 0.0
    """``$DSV3SERVE_RANK_STACKS_S``: every spawned group rank (``LLM(tp_size=N)``) dumps
    every thread's stack to stderr this often, in seconds (0, the default: never), to see
    where a stalled group waits."""
    fused_mla: bool = True
    """``$DSV3SERVE_FUSED_MLA``: ``0``/``false``/``off``/``no`` turns off the MLA fusions (the
    q/kv norms of the down-projection's output in one kernel, RoPE inside the KV-cache
    write); on otherwise."""
    worker_multiproc_method: str = "forkserver"
    """``$DSV3SERVE_WORKER_MULTIPROC_METHOD`` (vLLM's ``VLLM_WORKER_MULTIPROC_METHOD``): how
    ``LLM(tp_size=N)`` starts its follower ranks. ``forkserver`` (the default) forks each
    from one server that imported torch and the engine once; ``spawn`` starts a fresh
    interpreter per rank (:mod:`dsv3serve.engine.group.rank_start`)."""

    def __post_init__(self) -> None:
        if self.worker_multiproc_method not in WORKER_MULTIPROC_METHODS:
            raise ValueError(
                f"{WORKER_MULTIPROC_ENV}: expected one of {', '.join(WORKER_MULTIPROC_METHODS)},"
                f" got {self.worker_multiproc_method!r}"
            )

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, api_key_env: str | None = None
    ) -> Settings:
        """Read the settings from ``environ`` (default: this process's environment).

        ``api_key_env`` names the variable that holds the API key in place of
        ``$DSV3SERVE_API_KEY``.
        """
        env = os.environ if environ is None else environ
        cache = env.get(CACHE_ENV)
        return cls(
            cache_dir=Path(cache) if cache is not None else Path.home() / ".cache" / "dsv3serve",
            api_key=env.get(api_key_env or API_KEY_ENV, "").strip(),
            fused_norm_quant=_switch(env, FUSED_NORM_QUANT_ENV),
            fused_mla=_switch(env, FUSED_MLA_ENV),
            rank_stacks_s=float(env.get(RANK_STACKS_ENV, "0") or 0),
            worker_multiproc_method=env.get(WORKER_MULTIPROC_ENV, "forkserver").strip().lower(),
        )

    def compile_cache_env(self) -> dict[str, str]:
        """The compile caches' variables, each pointing into :attr:`cache_dir`."""
        return {name: str(self.cache_dir / sub) for name, sub in COMPILE_CACHE_ENV.items()}

    def __repr__(self) -> str:  # never print the key
        key = "set" if self.api_key else "unset"
        return (
            f"Settings(cache_dir={str(self.cache_dir)!r}, api_key={key}, "
            f"fused_norm_quant={self.fused_norm_quant}, fused_mla={self.fused_mla})"
        )


def _switch(env: Mapping[str, str], name: str) -> bool:
    """An on-by-default switch: off for ``0``/``false``/``off``/``no`` (any case)."""
    return env.get(name, "1").strip().lower() not in _OFF


def export_compile_caches(
    cache_dir: Path | None = None, environ: MutableMapping[str, str] | None = None
) -> dict[str, str]:
    """Point the compile caches into the cache dir, before anything reads them.

    ``cache_dir`` (the CLI's ``--cache-dir``) becomes ``$DSV3SERVE_CACHE``; each variable of
    :data:`COMPILE_CACHE_ENV` that is not already set gets its folder there (one set by hand
    wins). Child processes (TP ranks, Ray workers started from here) inherit them. Call it
    before flashinfer is first imported: it reads its variable at import. Returns the
    variables as they now are.
    """
    env = os.environ if environ is None else environ
    if cache_dir is not None:
        env[CACHE_ENV] = str(cache_dir)
    for name, value in Settings.from_env(env).compile_cache_env().items():
        env.setdefault(name, value)
    return {name: env[name] for name in COMPILE_CACHE_ENV}
