"""Batched next-token sampling on the device that holds the logits (CPU or CUDA).

Per step the engine builds one :class:`SamplingBatch` (host work: gather per-row
parameters, count token histories) and calls :meth:`Sampler.sample` (device work only,
no host-device sync). Order of operations per row:

0. logit controls: ``logit_bias`` is added, then tokens outside the row's structured-output
   mask (a host-built bitmask, unpacked on the device) are set to ``-inf``;
1. penalties on the float32 logits: repetition (HF/vLLM: divide positive logits and
   multiply negative ones of tokens seen in prompt or output), then frequency and
   presence (OpenAI: ``logit -= freq * count + presence * (count > 0)``, output tokens);
2. logprobs: ``log_softmax`` of the penalised logits, before temperature and filtering
   (vLLM V1's default ``raw_logprobs`` are taken before penalties; ours include them);
3. greedy rows: ``argmax`` of the penalised logits;
4. random rows: divide by temperature; keep the ``top_k`` best; keep the smallest prefix
   of the sorted, top-k-renormalised probabilities whose mass reaches ``top_p``; drop
   tokens whose probability is below ``min_p * max_prob``; sample.

Sampling uses the exponential race: ``token = argmax(p_i / E_i)`` with ``E_i ~ Exp(1)``
i.i.d., which draws ``i`` with probability ``p_i / sum(p)`` and never picks a filtered
token. Each seeded row draws its ``V`` exponentials from its own generator, in vocab
order, so its tokens do not depend on the other rows of the batch or their order;
unseeded rows share the sampler's generator (or torch's default one).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch
from torch import Tensor

from dsv3serve.sampling.sampling_params import SamplingParams


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """A generator on ``device`` seeded with ``seed``, for one seeded request."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


@dataclass(frozen=True)
class PenaltyTensors:
    """Penalty parameters and token statistics of a batch (B rows, vocab V).

    ``seen`` [B, V] bool: token occurs in the prompt or the output (repetition penalty).
    ``output_counts`` [B, V] int32: occurrences in the output (frequency / presence).
    The three penalty vectors are [B] float32; rows without penalties hold 1 / 0 / 0.
    """

    repetition: Tensor
    frequency: Tensor
    presence: Tensor
    seen: Tensor
    output_counts: Tensor


@dataclass(frozen=True)
class SamplingBatch:
    """Device-side sampling metadata for one step; build with :meth:`build`.

    All tensors are [B] on the logits' device. ``temperature`` holds 1.0 on greedy rows
    (they never use it); ``top_k`` holds V where top-k is disabled. The booleans are
    host-side summaries so :class:`Sampler` can skip work without syncing.
    """

    temperature: Tensor
    greedy: Tensor
    top_k: Tensor
    top_p: Tensor
    min_p: Tensor
    penalties: PenaltyTensors | None
    generators: tuple[torch.Generator | None, ...]
    vocab_size: int
    num_top_logprobs: int
    all_greedy: bool
    any_greedy: bool
    needs_sort: bool
    needs_min_p: bool
    bias: Tensor | None = None
    allowed: Tensor | None = None

    @property
    def size(self) -> int:
        """Number of rows B."""
        return len(self.generators)

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        prompt_ids: Sequence[Sequence[int]],
        output_ids: Sequence[Sequence[int]],
        vocab_size: int,
        device: torch.device | str,
        bitmask: Tensor | None = None,
    ) -> SamplingBatch:
        """Gather per-row parameters and token histories into device tensors.

        Row ``i`` uses ``params[i]``, ``generators[i]`` (required, and on ``device``,
        exactly when ``params[i].seed`` is set), and its history ``prompt_ids[i]`` +
        ``output_ids[i]`` (token ids in ``[0, vocab_size)``), read only by rows with
        penalties. ``bitmask``: host int32 [B, ceil(V / 32)], bit ``t % 32`` of word
        ``t // 32`` set where token ``t`` is allowed (``engine/grammar.py``), or None.
        """
        device = torch.device(device)
        _check_rows(params, generators, prompt_ids, output_ids, device)
        greedy = [p.is_greedy for p in params]
        top_k = [p.top_k if 1 <= p.top_k < vocab_size else vocab_size for p in params]
        top_p = [p.top_p for p in params]
        requested = [p.logprobs or 0 for p in params]
        temperature = [1.0 if p.is_greedy else p.temperature for p in params]
        rows = _upload([temperature, greedy, top_k, top_p, [p.min_p for p in params]], device)
        return cls(
            temperature=rows[0],
            greedy=rows[1] > 0.5,
            top_k=rows[2].to(torch.int64),  # exact: vocabulary ids are far below 2**24
            top_p=rows[3],
            min_p=rows[4],
            penalties=_build_penalties(params, prompt_ids, output_ids, vocab_size, device),
            generators=tuple(generators),
            vocab_size=vocab_size,
            num_top_logprobs=min(max(requested, default=0), vocab_size),
            all_greedy=all(greedy),
            any_greedy=any(greedy),
            needs_sort=min(top_k, default=vocab_size) < vocab_size or min(top_p, default=1.0) < 1.0,
            needs_min_p=any(p.min_p > 0.0 for p in params),
            bias=_build_bias(params, vocab_size, device),
            allowed=None if bitmask is None else _unpack_bitmask(bitmask, vocab_size, device),
        )


def _check_rows(
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    prompt_ids: Sequence[Sequence[int]],
    output_ids: Sequence[Sequence[int]],
    device: torch.device,
) -> None:
    lengths = {len(params), len(generators), len(prompt_ids), len(output_ids)}
    if len(lengths) != 1:
        raise ValueError(
            f"expected one entry per row in params, generators, prompt_ids and output_ids, "
            f"got lengths {len(params)}, {len(generators)}, {len(prompt_ids)}, {len(output_ids)}"
        )
    for row, (p, g) in enumerate(zip(params, generators, strict=True)):
        if (p.seed is None) != (g is None):
            raise ValueError(
                f"row {row}: expected a generator exactly when seed is set, "
                f"got seed={p.seed} and generator={g}"
            )
        if g is not None and g.device.type != device.type:
            raise ValueError(f"row {row}: expected a generator on {device}, got {g.device}")


def _upload(rows: Sequence[Sequence[float]], device: torch.device) -> Tensor:
    """Per-row parameters [len(rows), B] float32 on ``device`` in one copy: pinned and
    non-blocking on CUDA, so launching a step's sampling does not wait for its forward."""
    return _to_device(torch.tensor(rows, dtype=torch.float32), device)


def _to_device(host: Tensor, device: torch.device) -> Tensor:
    """``host`` on ``device``: pinned and non-blocking on CUDA."""
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def _build_bias(
    params: Sequence[SamplingParams], vocab_size: int, device: torch.device
) -> Tensor | None:
    """[B, V] float32 with each row's ``logit_bias`` scattered in (ids checked < V)."""
    entries = [(row, t, b) for row, p in enumerate(params) for t, b in p.logit_bias.items()]
    if not entries:
        return None
    bad = [t for _, t, _ in entries if t >= vocab_size]
    if bad:
        raise ValueError(f"expected logit_bias token ids in [0, {vocab_size}), got {bad[:5]}")
    flat = torch.tensor([row * vocab_size + t for row, t, _ in entries], dtype=torch.int64)
    values = torch.tensor([b for _, _, b in entries], dtype=torch.float32)
    bias = torch.zeros(len(params) * vocab_size, dtype=torch.float32, device=device)
    bias.index_put_((_to_device(flat, device),), _to_device(values, device))
    return bias.view(len(params), vocab_size)


def _unpack_bitmask(bitmask: Tensor, vocab_size: int, device: torch.device) -> Tensor:
    """[B, V] bool from a host int32 bitmask [B, ceil(V / 32)], unpacked on ``device``."""
    rows, words = bitmask.shape
    if words * 32 < vocab_size or bitmask.dtype != torch.int32:
        raise ValueError(
            f"expected an int32 bitmask of >= {(vocab_size + 31) // 32} words per row, "
            f"got {bitmask.dtype} {tuple(bitmask.shape)}"
        )
    packed = _to_device(bitmask, device)
    shifts = torch.arange(32, dtype=torch.int32, device=device)
    bits = (packed.unsqueeze(-1) >> shifts) & 1
    return bits.view(rows, words * 32)[:, :vocab_size].bool()


def _build_penalties(
    params: Sequence[SamplingParams],
    prompt_ids: Sequence[Sequence[int]],
    output_ids: Sequence[Sequence[int]],
    vocab_size: int,
    device: torch.device,
) -> PenaltyTensors | None:
    if not any(p.has_penalties for p in params):
        return None
    uses_repetition = [p.repetition_penalty != 1.0 for p in params]
    uses_counts = [p.has_penalties for p in params]
    prompts = [ids if used else () for ids, used in zip(prompt_ids, uses_repetition, strict=True)]
    outputs = [ids if used else () for ids, used in zip(output_ids, uses_counts, strict=True)]
    output_counts = _count_tokens(outputs, vocab_size, device)
    seen = _mark_tokens(prompts, vocab_size, device) | (output_counts > 0)
    rep, freq, pres = _upload(
        [
            [p.repetition_penalty for p in params],
            [p.frequency_penalty for p in params],
            [p.presence_penalty for p in params],
        ],
        device,
    )
    return PenaltyTensors(
        repetition=rep,
        frequency=freq,
        presence=pres,
        seen=seen,
        output_counts=output_counts,
    )


def _flat_indices(histories: Sequence[Sequence[int]], vocab_size: int) -> Tensor:
    """Host int64 ``row * V + token`` over all histories, checked to lie in the vocab."""
    lengths = [len(h) for h in histories]
    ids = np.fromiter(chain.from_iterable(histories), dtype=np.int64, count=sum(lengths))
    if ids.size and not (ids.min() >= 0 and ids.max() < vocab_size):
        raise ValueError(
            f"expected token ids in [0, {vocab_size}), got range [{ids.min()}, {ids.max()}]"
        )
    rows = np.repeat(np.arange(len(histories), dtype=np.int64), lengths)
    return torch.from_numpy(rows * vocab_size + ids)


def _count_tokens(
    histories: Sequence[Sequence[int]], vocab_size: int, device: torch.device
) -> Tensor:
    """[B, V] int32 occurrence counts, by one scatter-add over the flattened histories."""
    flat = _flat_indices(histories, vocab_size).to(device)
    counts = torch.zeros(len(histories) * vocab_size, dtype=torch.int32, device=device)
    ones = torch.ones_like(flat, dtype=torch.int32)
    return counts.index_add_(0, flat, ones).view(len(histories), vocab_size)


def _mark_tokens(
    histories: Sequence[Sequence[int]], vocab_size: int, device: torch.device
) -> Tensor:
    """[B, V] bool, True where the token occurs in the row's history."""
    flat = _flat_indices(histories, vocab_size).to(device)
    seen = torch.zeros(len(histories) * vocab_size, dtype=torch.bool, device=device)
    return seen.index_fill_(0, flat, True).view(len(histories), vocab_size)


@dataclass(frozen=True)
class SampleOutput:
    """Result of one sampling step for B rows.

    ``token_ids`` [B] int64; ``logprobs`` [B] float32, log-softmax of the penalised
    logits at the chosen token; ``top_logprobs`` ``(values [B, k] float32, ids [B, k]
    int64)`` sorted descending, with k the largest ``logprobs`` requested in the batch,
    or ``None`` when k is 0.
    """

    token_ids: Tensor
    logprobs: Tensor
    top_logprobs: tuple[Tensor, Tensor] | None


class Sampler:
    """Turns last-position logits into next tokens; see the module docstring."""

    def __init__(self, generator: torch.Generator | None = None) -> None:
        """``generator`` drives unseeded rows; ``None`` uses torch's default generator."""
        self.generator = generator

    def sample(self, logits: Tensor, batch: SamplingBatch) -> SampleOutput:
        """Pick one token per row of ``logits`` [B, V] float32; ``logits`` is not modified."""
        expected = (batch.size, batch.vocab_size)
        assert logits.dtype == torch.float32, f"expected float32 logits, got {logits.dtype}"
        assert tuple(logits.shape) == expected, f"expected logits {expected}, got {logits.shape}"
        logits = apply_logit_controls(logits, batch)
        if batch.penalties is not None:
            logits = apply_penalties(logits, batch.penalties)
        token_ids = self._choose(logits, batch)
        log_norm = torch.logsumexp(logits, dim=-1, keepdim=True)
        chosen = logits.gather(1, token_ids.unsqueeze(1)) - log_norm
        return SampleOutput(token_ids, chosen.squeeze(1), _top_logprobs(logits, log_norm, batch))

    def _choose(self, logits: Tensor, batch: SamplingBatch) -> Tensor:
        if batch.all_greedy:
            return logits.argmax(dim=-1)
        sampled = self._sample_random(logits, batch)
        if not batch.any_greedy:
            return sampled
        return torch.where(batch.greedy, logits.argmax(dim=-1), sampled)

    def _sample_random(self, logits: Tensor, batch: SamplingBatch) -> Tensor:
        probs = filtered_probs(logits / batch.temperature.unsqueeze(1), batch)
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for row, generator in enumerate(batch.generators):
            if generator is not None:
                noise[row].exponential_(generator=generator)
        # Exp(1) draws can be exactly 0 in float32; p / 0 would tie at inf or give NaN.
        noise.clamp_(min=torch.finfo(noise.dtype).tiny)
        return (probs / noise).argmax(dim=-1)


def apply_logit_controls(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """``logit_bias`` added, then tokens outside the structured-output mask set to -inf;
    returns ``logits`` itself when the batch has neither."""
    if batch.bias is not None:
        logits = logits + batch.bias
    if batch.allowed is not None:
        logits = logits.masked_fill(~batch.allowed, -torch.inf)
    return logits


def apply_penalties(logits: Tensor, penalties: PenaltyTensors) -> Tensor:
    """Repetition, then frequency and presence penalties; returns a new [B, V] tensor."""
    repetition = torch.where(penalties.seen, penalties.repetition.unsqueeze(1), 1.0)
    logits = torch.where(logits > 0, logits / repetition, logits * repetition)
    counts = penalties.output_counts.to(logits.dtype)
    logits = logits - penalties.frequency.unsqueeze(1) * counts
    return logits - penalties.presence.unsqueeze(1) * (counts > 0).to(logits.dtype)


def filtered_probs(scaled_logits: Tensor, batch: SamplingBatch) -> Tensor:
    """[B, V] probabilities kept by top-k, top-p, then min-p; zero elsewhere, not renormalised."""
    if batch.needs_sort:
        scaled_logits = scaled_logits.masked_fill(
            _top_k_top_p_mask(scaled_logits, batch), -torch.inf
        )
    probs = torch.softmax(scaled_logits, dim=-1)
    if batch.needs_min_p:
        threshold = batch.min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
        probs = probs.masked_fill(probs < threshold, 0.0)
    return probs


def _top_k_top_p_mask(scaled_logits: Tensor, batch: SamplingBatch) -> Tensor:
    """[B, V] bool, True for tokens removed by top-k or top-p (never the best token)."""
    sorted_logits, order = scaled_logits.sort(dim=-1, descending=True, stable=True)
    ranks = torch.arange(batch.vocab_size, device=scaled_logits.device)
    removed = ranks >= batch.top_k.unsqueeze(1)
    sorted_probs = torch.softmax(sorted_logits.masked_fill(removed, -torch.inf), dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    # top_p == 1 must remove nothing, even where the float32 cumsum overshoots 1.
    nucleus_active = (batch.top_p < 1.0).unsqueeze(1)
    removed |= nucleus_active & (mass_before >= batch.top_p.unsqueeze(1))
    return torch.empty_like(removed).scatter_(1, order, removed)


def _top_logprobs(
    logits: Tensor, log_norm: Tensor, batch: SamplingBatch
) -> tuple[Tensor, Tensor] | None:
    if batch.num_top_logprobs == 0:
        return None
    values, ids = logits.topk(batch.num_top_logprobs, dim=-1)
    return values - log_norm, ids
