"""Compile the Triton launches of a Python call for a GPU that is not there (ahead of time).

:func:`compile_launches` runs a function with every named kernel replaced by a recorder; each
recorded launch (CPU tensors stand in for device ones: only dtypes, alignment and values of
the scalars matter) is then specialised and compiled exactly as Triton's launcher would, for
the given target, down to a cubin through the ``ptxas`` that ships with Triton. This catches
what the interpreter cannot: type errors of the compiled language, unsupported layouts, and
shared memory over the device's limit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

HOPPER_SMEM_BYTES = 232_448  # H100/H200: 227 KB of shared memory per block


@dataclass
class Launch:
    kernel: Any  # triton.runtime.jit.JITFunction
    args: tuple
    kwargs: dict


class _Recorder:
    def __init__(self, kernel: Any, sink: list[Launch]) -> None:
        self.kernel, self.sink = kernel, sink

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        return lambda *args, **kwargs: self.sink.append(Launch(self.kernel, args, kwargs))


@contextmanager
def recorded(module: Any, names: list[str]) -> Iterator[list[Launch]]:
    """Within the block, ``module.<name>[grid](...)`` records instead of launching."""
    sink: list[Launch] = []
    saved = {n: getattr(module, n) for n in names}
    for n, k in saved.items():
        setattr(module, n, _Recorder(k, sink))
    try:
        yield sink
    finally:
        for n, k in saved.items():
            setattr(module, n, k)


def compile_launch(launch: Launch, capability: int = 90) -> Any:
    """The CompiledKernel Triton would build for this launch on a CUDA device of ``capability``."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    fn = launch.kernel
    target = GPUTarget("cuda", capability, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*launch.args, **launch.kwargs)
    options, signature, constexprs, attrs = fn._pack_args(
        backend, launch.kwargs, bound, specialization, options
    )
    src = ASTSource(fn, signature, constexprs, attrs)
    return triton.compile(src, target=target, options=options.__dict__)
