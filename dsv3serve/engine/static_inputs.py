"""The static input buffers a CUDA graph reads, filled by one host-to-device copy.

A graph replays over fixed addresses, so each step's token ids, positions, output slots
and logits rows are written into buffers the graph captured. :class:`StaticInputs` keeps
all of them, and ``real`` (how many rows are real tokens), in ONE device tensor, and
fills it from a host staging copy of the same layout: the host writes the step's arrays
(and the defaults of the unused tail) into the stage, then one non-blocking copy moves
it. On CUDA the stages are pinned and alternate, so filling one never races the copy
still reading the other; before a stage is reused, the copy that last read it is waited
for (it ran long ago: the engine syncs on sampling every step).

Layout (int64, ``m = max_tokens``): ids ``[0, m)``, positions ``[m, 2m)``, output slots
``[2m, 3m)`` (the tail points at a scratch slot), logits rows ``[3m, 4m)``, ``real`` at
``4m``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from dsv3serve.forward_batch import ForwardBatch, SeqSpan

_STAGES = 2  # alternating host stages (one may still be read by the last copy)


class StaticInputs:
    """Token ids, positions, output slots and logits rows [max_tokens] (int64) a graph
    reads, and ``real``: how many of the rows are real tokens (a 0-dim int64 view; the
    rest pad)."""

    def __init__(self, max_tokens: int, fill_slot: int, device: torch.device) -> None:
        """``fill_slot``: a scratch slot the unused tail of ``out_slots`` points at. The
        buffers are normal tensors even when made in inference mode (later fills may run
        outside it)."""
        with torch.inference_mode(False):
            self._allocate(max_tokens, fill_slot, device)

    def _allocate(self, max_tokens: int, fill_slot: int, device: torch.device) -> None:
        m = self._max = max_tokens
        self.device = device
        template = np.zeros(4 * m + 1, dtype=np.int64)
        template[2 * m : 3 * m] = fill_slot
        self._template = template
        self._buffer = torch.from_numpy(template.copy()).to(device)
        self.ids, self.pos = self._buffer[:m], self._buffer[m : 2 * m]
        self.out, self.rows = self._buffer[2 * m : 3 * m], self._buffer[3 * m : 4 * m]
        self.real = self._buffer[4 * m]
        pin = device.type == "cuda"
        self._stages = [torch.from_numpy(template.copy()) for _ in range(_STAGES)]
        if pin:
            self._stages = [stage.pin_memory() for stage in self._stages]
        self._copied: list[torch.Event | None] = [None] * _STAGES
        self._turn = 0

    def upload(self, arrays: Sequence[np.ndarray], real: int | None = None) -> list[torch.Tensor]:
        """``[ids, positions, out_slots, logits_rows]`` into the buffers in one copy;
        returns views of the first ``len(ids)`` rows (``len(logits_rows)`` of the last).
        ``real``: how many leading rows are real tokens (None: all of them)."""
        ids, pos, out, rows = arrays
        n, m = len(ids), self._max
        if n > m or len(rows) > m:
            raise ValueError(f"expected at most {m} graph tokens, got {n}")
        stage = self._next_stage()
        host = stage.numpy()
        host[:] = self._template
        host[:n], host[m : m + n], host[2 * m : 2 * m + n] = ids, pos, out
        host[3 * m : 3 * m + len(rows)] = rows
        host[4 * m] = n if real is None else real
        self._buffer.copy_(stage, non_blocking=True)
        self._mark_copied()
        return [self.ids[:n], self.pos[:n], self.out[:n], self.rows[: len(rows)]]

    def build(self, spans: list[SeqSpan], real: int | None = None) -> ForwardBatch:
        """A decode-form :class:`ForwardBatch` over ``spans`` whose per-token inputs are
        views of these buffers (see :meth:`upload` for ``real``)."""
        return ForwardBatch.build(
            spans, self.device, decode=True, upload=lambda arrays: self.upload(arrays, real)
        )

    def _next_stage(self) -> torch.Tensor:
        """The host stage to fill, once the copy that last read it has run."""
        self._turn = (self._turn + 1) % _STAGES
        event = self._copied[self._turn]
        if event is not None:
            event.synchronize()
        return self._stages[self._turn]

    def _mark_copied(self) -> None:
        """Record the copy's event. ``torch.Event`` records on the current stream in C++;
        ``torch.cuda.Event.record()`` builds a Python ``Stream`` first (in run 9's cProfile of
        the batch-1 step, ``current_stream`` was 0.098 of the two records' 0.120 ms)."""
        if self.device.type != "cuda":
            return
        event = self._copied[self._turn]
        if event is None:
            event = self._copied[self._turn] = torch.Event(device=self.device)
        event.record()
