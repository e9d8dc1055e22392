"""Per-step forward metadata, built once per scheduler step and shared by every layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SeqSpan:
    """One sequence's part of a step: tokens ``start .. start+len(token_ids)`` of it."""

    token_ids: list[int]
    start: int  # position of the first new token (= tokens already in the cache)
    kv_slots: list[int]  # cache slots of positions 0 .. start+len(token_ids)-1
    sample: bool = True  # whether logits are needed at the last new token


@dataclass
class ForwardBatch:
    """Flattened tokens of a batch of sequences plus their paged-cache addressing.

    ``qo_indptr`` / ``kv_indptr`` are host lists (length B+1) delimiting each sequence's
    new tokens in the T-long token arrays and its KV slots in ``kv_slots``.
    """

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    out_slots: torch.Tensor  # [T] int64, cache slot written for each new token
    kv_slots: torch.Tensor  # [sum(seq_lens)] int64
    qo_indptr: list[int]
    kv_indptr: list[int]
    logits_indices: torch.Tensor  # [N] rows of T whose logits are computed
    is_decode: bool
    kv_slots_host: torch.Tensor | None = None  # kv_slots on the CPU, for host-side planning

    @property
    def batch_size(self) -> int:
        return len(self.qo_indptr) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @classmethod
    def build(
        cls, spans: list[SeqSpan], device: torch.device | str, decode: bool | None = None
    ) -> ForwardBatch:
        """Flatten ``spans`` into device tensors (one host-to-device copy per field).

        ``is_decode`` is ``decode``, or when None whether every span has one token. A
        speculative verify (a few tokens per sequence over its cache) passes True.
        """
        ids: list[int] = []
        pos: list[int] = []
        out: list[int] = []
        kv: list[int] = []
        qo_indptr, kv_indptr, logits_rows = [0], [0], []
        for span in spans:
            n = len(span.token_ids)
            end = span.start + n
            if len(span.kv_slots) != end:
                raise ValueError(f"span needs {end} kv slots, got {len(span.kv_slots)}")
            ids += span.token_ids
            pos += range(span.start, end)
            out += span.kv_slots[span.start : end]
            kv += span.kv_slots
            qo_indptr.append(qo_indptr[-1] + n)
            kv_indptr.append(kv_indptr[-1] + end)
            if span.sample:
                logits_rows.append(qo_indptr[-1] - 1)

        def t(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        kv_host = torch.tensor(kv, dtype=torch.int64)
        return cls(
            input_ids=t(ids),
            positions=t(pos),
            out_slots=t(out),
            kv_slots=kv_host.to(device),
            qo_indptr=qo_indptr,
            kv_indptr=kv_indptr,
            logits_indices=t(logits_rows),
            is_decode=all(len(s.token_ids) == 1 for s in spans) if decode is None else decode,
            kv_slots_host=kv_host,
        )
