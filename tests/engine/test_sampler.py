"""Sampler against independent references: argmax, plain-Python penalties and filters,
torch.log_softmax / topk, chi-square goodness of fit, and seed reproducibility."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
import torch

from dsv3serve.engine.sampler import (
    SampleOutput,
    Sampler,
    SamplingBatch,
    apply_penalties,
    filtered_probs,
    make_generator,
)
from dsv3serve.sampling.sampling_params import SamplingParams

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
        ],
    ),
]
# Upper 0.1% points of the chi-square distribution (alpha = 1e-3), by degrees of freedom.
CHI2_CRITICAL_ALPHA_1E3 = {
    1: 10.828,
    2: 13.816,
    3: 16.266,
    4: 18.467,
    5: 20.515,
    6: 22.458,
    7: 24.322,
    8: 26.124,
    9: 27.877,
}
NUM_DRAWS = 20_000


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    return request.param


def make_batch(
    params: Sequence[SamplingParams],
    vocab: int,
    device: str,
    prompts: Sequence[Sequence[int]] | None = None,
    outputs: Sequence[Sequence[int]] | None = None,
) -> SamplingBatch:
    generators = [None if p.seed is None else make_generator(p.seed, device) for p in params]
    empty: list[list[int]] = [[] for _ in params]
    return SamplingBatch.build(
        params, generators, prompts or empty, outputs or empty, vocab, device
    )


def sample(
    logits: torch.Tensor, params: Sequence[SamplingParams], device: str, seed: int = 0
) -> SampleOutput:
    sampler = Sampler(make_generator(seed, device))
    return sampler.sample(logits.to(device), make_batch(params, logits.shape[1], device))


def assert_chi_square_fit(tokens: torch.Tensor, expected: list[float]) -> None:
    """Observed token counts fit ``expected`` probabilities at alpha = 1e-3."""
    counts = torch.bincount(tokens.cpu(), minlength=len(expected)).tolist()
    support = [i for i, p in enumerate(expected) if p > 0]
    assert all(counts[i] == 0 for i, p in enumerate(expected) if p == 0), counts
    n = sum(counts)
    stat = sum((counts[i] - n * expected[i]) ** 2 / (n * expected[i]) for i in support)
    assert stat < CHI2_CRITICAL_ALPHA_1E3[len(support) - 1], (stat, counts, expected)


def python_softmax(logits: Sequence[float], temperature: float = 1.0) -> list[float]:
    top = max(logits)
    weights = [math.exp((x - top) / temperature) for x in logits]
    return [w / sum(weights) for w in weights]


def python_filtered(probs: list[float], top_k: int, top_p: float, min_p: float) -> list[float]:
    """Reference top-k, then top-p on the renormalised rest, then min-p; renormalised."""
    order = sorted(range(len(probs)), key=lambda i: -probs[i])[:top_k]
    kept_mass = sum(probs[i] for i in order)
    nucleus, mass = [], 0.0
    for i in order:
        nucleus.append(i)
        mass += probs[i] / kept_mass
        if mass >= top_p:
            break
    best = max(probs[i] for i in nucleus)
    final = [i for i in nucleus if probs[i] >= min_p * best]
    total = sum(probs[i] for i in final)
    return [probs[i] / total if i in final else 0.0 for i in range(len(probs))]


def python_penalties(
    logits: list[float], prompt: list[int], output: list[int], p: SamplingParams
) -> list[float]:
    result = []
    for token, value in enumerate(logits):
        if token in prompt or token in output:
            rp = p.repetition_penalty
            value = value / rp if value > 0 else value * rp
        count = output.count(token)
        value -= p.frequency_penalty * count + p.presence_penalty * (1 if count else 0)
        result.append(value)
    return result


def test_greedy_is_argmax(device: str) -> None:
    logits = torch.randn(16, 1000, generator=torch.Generator().manual_seed(0))
    out = sample(logits, [SamplingParams(temperature=0.0)] * 16, device)
    assert torch.equal(out.token_ids.cpu(), logits.argmax(dim=-1))
    assert out.token_ids.dtype == torch.int64


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.5, top_k=1),
        SamplingParams(temperature=1.5, top_p=1e-6),
        SamplingParams(temperature=1.5, min_p=1.0),
    ],
    ids=["top_k=1", "top_p=1e-6", "min_p=1"],
)
def test_single_survivor_filters_equal_greedy(params: SamplingParams, device: str) -> None:
    logits = torch.randn(256, 300, generator=torch.Generator().manual_seed(1))
    out = sample(logits, [params] * 256, device)
    assert torch.equal(out.token_ids.cpu(), logits.argmax(dim=-1))


def test_mixed_batch_greedy_rows_stay_argmax(device: str) -> None:
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(temperature=0.0 if i % 2 else 2.0) for i in range(8)]
    out = sample(logits, params, device)
    assert torch.equal(out.token_ids.cpu()[1::2], logits.argmax(dim=-1)[1::2])


def test_temperature_sampling_fits_softmax(device: str) -> None:
    row = [1.2, -0.3, 0.4, 1.5, -1.0, 0.0, 0.9, -0.6]
    logits = torch.tensor([row]).expand(NUM_DRAWS, -1).contiguous()
    out = sample(logits, [SamplingParams(temperature=0.7)] * NUM_DRAWS, device)
    assert_chi_square_fit(out.token_ids, python_softmax(row, temperature=0.7))


@pytest.mark.parametrize(
    ("top_k", "top_p", "min_p", "survivors"),
    [
        (6, 1.0, 0.0, 6),
        # 6 -> 4 by top-p on the renormalised top-6 (5 if top-p ignored top-k's renormalising)
        (6, 0.85, 0.0, 4),
        (6, 0.9, 0.2, 4),  # 6 -> 5 by top-p -> 4 by min-p: every filter removes a token
    ],
)
def test_top_k_top_p_min_p_fit_reference(
    top_k: int, top_p: float, min_p: float, survivors: int, device: str
) -> None:
    row = [0.5, 2.0, -1.0, 1.2, 0.0, 1.5, -2.0, 1.0, 0.3, -0.5]
    params = SamplingParams(temperature=0.8, top_k=top_k, top_p=top_p, min_p=min_p)
    expected = python_filtered(python_softmax(row, 0.8), top_k, top_p, min_p)
    assert sum(p > 0 for p in expected) == survivors
    logits = torch.tensor([row]).expand(NUM_DRAWS, -1).contiguous()
    out = sample(logits, [params] * NUM_DRAWS, device)
    assert_chi_square_fit(out.token_ids, expected)


def test_disabled_filters_keep_every_token_in_a_filtering_batch(device: str) -> None:
    # A peaked row over a DeepSeek-size vocab: its float32 cumsum passes 1.0 long before
    # the tail, so top_p = 1 must be special-cased to keep row 0 independent of row 1.
    logits = (torch.randn(2, 129_280, generator=torch.Generator().manual_seed(5)) * 4).to(device)
    batch = make_batch([SamplingParams(), SamplingParams(top_k=5)], 129_280, device)
    assert batch.needs_sort
    probs = filtered_probs(logits, batch)
    torch.testing.assert_close(probs[0], torch.softmax(logits[0], dim=-1), rtol=0, atol=0)
    assert int((probs[1] > 0).sum()) == 5


def test_min_p_never_samples_below_threshold(device: str) -> None:
    row = [3.0, 2.8, 1.0, 0.5, 2.0, -1.0, 2.5, 0.0]
    probs = python_softmax(row)
    allowed = {i for i, p in enumerate(probs) if p >= 0.2 * max(probs)}
    logits = torch.tensor([row]).expand(NUM_DRAWS, -1).contiguous()
    out = sample(logits, [SamplingParams(min_p=0.2)] * NUM_DRAWS, device)
    assert set(out.token_ids.tolist()) == allowed  # all kept tokens seen, no removed one
    assert_chi_square_fit(out.token_ids, python_filtered(probs, len(row), 1.0, 0.2))


def test_penalties_match_python_reference(device: str) -> None:
    vocab = 12
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=1.5, logprobs=3),
        SamplingParams(temperature=0.0, frequency_penalty=0.7, presence_penalty=0.4),
        SamplingParams(
            temperature=0.0,
            repetition_penalty=0.8,
            frequency_penalty=-0.5,
            presence_penalty=1.1,
            logprobs=5,
        ),
        SamplingParams(temperature=0.0),
    ]
    prompts = [[1, 2, 2], [1], [7], [1, 2, 3]]
    outputs = [[3, 3, 5], [0, 0, 0, 4, 11], [7, 8, 8], [2]]
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(3)) * 3
    logits[0, 2] = 0.0
    expected = torch.tensor(
        [python_penalties(logits[r].tolist(), prompts[r], outputs[r], params[r]) for r in range(4)]
    )
    batch = make_batch(params, vocab, device, prompts, outputs)
    assert batch.penalties is not None
    penalised = apply_penalties(logits.to(device), batch.penalties).cpu()
    torch.testing.assert_close(penalised, expected)
    out = Sampler().sample(logits.to(device), batch)
    reference = torch.log_softmax(expected, dim=-1)
    assert torch.equal(out.token_ids.cpu(), expected.argmax(dim=-1))
    torch.testing.assert_close(
        out.logprobs.cpu(), reference.gather(1, out.token_ids.cpu()[:, None])[:, 0]
    )
    assert out.top_logprobs is not None
    values, ids = out.top_logprobs
    ref_values, ref_ids = torch.topk(reference, 5)
    assert torch.equal(ids.cpu(), ref_ids)
    torch.testing.assert_close(values.cpu(), ref_values)


def test_logprobs_are_log_softmax_before_temperature(device: str) -> None:
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(4)) * 2
    params = [
        SamplingParams(temperature=t, top_k=5, logprobs=2) for t in (0.3, 0.7, 1.0, 1.3, 2.0, 0.0)
    ]
    before = logits.clone()
    out = sample(logits, params, device)
    reference = torch.log_softmax(logits, dim=-1)
    torch.testing.assert_close(
        out.logprobs.cpu(), reference.gather(1, out.token_ids.cpu()[:, None])[:, 0]
    )
    assert out.top_logprobs is not None
    ref_values, ref_ids = torch.topk(reference, 2)
    assert torch.equal(out.top_logprobs[1].cpu(), ref_ids)
    torch.testing.assert_close(out.top_logprobs[0].cpu(), ref_values)
    assert torch.equal(logits, before)


@pytest.mark.parametrize("requested", [[None, None], [0, None], [0, 0]])
def test_no_top_logprobs_unless_requested(requested: list[int | None]) -> None:
    logits = torch.randn(2, 10)
    out = sample(logits, [SamplingParams(logprobs=k) for k in requested], "cpu")
    assert out.top_logprobs is None and out.logprobs.shape == (2,)


def run_requests(
    requests: Sequence[tuple[str, SamplingParams]], steps: int, vocab: int, device: str
) -> dict[str, list[int]]:
    """Decode ``steps`` tokens for named requests batched in the given order. Each
    request's logits at a step depend only on its name, the step and its own history."""
    params = [p for _, p in requests]
    generators = [None if p.seed is None else make_generator(p.seed, device) for p in params]
    prompts = [[sum(map(ord, name)) % vocab, 3] for name, _ in requests]
    outputs: list[list[int]] = [[] for _ in requests]
    sampler = Sampler()
    for step in range(steps):
        rows = [
            torch.randn(
                vocab, generator=torch.Generator().manual_seed(sum(map(ord, name)) * 1000 + step)
            )
            for name, _ in requests
        ]
        batch = SamplingBatch.build(params, generators, prompts, outputs, vocab, device)
        tokens = sampler.sample(torch.stack(rows).to(device), batch).token_ids.tolist()
        for history, token in zip(outputs, tokens, strict=True):
            history.append(token)
    return {name: out for (name, _), out in zip(requests, outputs, strict=True)}


def test_seeded_row_ignores_batch_composition_and_order(device: str) -> None:
    target = ("target", SamplingParams(temperature=1.0, repetition_penalty=1.3, seed=7))
    others = [
        ("top-k-seeded", SamplingParams(top_k=5, seed=99)),
        ("nucleus", SamplingParams(top_p=0.5, frequency_penalty=0.5)),
        ("greedy-one", SamplingParams(temperature=0.0)),
    ]
    alone = run_requests([target], 12, 256, device)["target"]
    mixed = run_requests([others[0], target, *others[1:]], 12, 256, device)["target"]
    reordered = run_requests([*reversed(others), target], 12, 256, device)["target"]
    assert alone == mixed == reordered
    assert len(set(alone)) > 3  # really sampled, not a constant sequence
    other_seed = ("target", target[1].model_copy(update={"seed": 8}))
    assert run_requests([other_seed], 12, 256, device)["target"] != alone


def test_top_k_at_or_above_vocab_is_disabled() -> None:
    batch = make_batch([SamplingParams(top_k=10), SamplingParams(top_k=0)], 10, "cpu")
    assert batch.top_k.tolist() == [10, 10] and not batch.needs_sort


def test_build_rejects_inconsistent_rows() -> None:
    seeded = SamplingParams(seed=1)
    with pytest.raises(ValueError, match="generator exactly when seed is set"):
        SamplingBatch.build([seeded], [None], [[]], [[]], 10, "cpu")
    with pytest.raises(ValueError, match="generator exactly when seed is set"):
        SamplingBatch.build([SamplingParams()], [make_generator(1, "cpu")], [[]], [[]], 10, "cpu")
    with pytest.raises(ValueError, match="one entry per row"):
        SamplingBatch.build([SamplingParams()], [None], [[], []], [[]], 10, "cpu")
    penalised = SamplingParams(presence_penalty=1.0)
    with pytest.raises(ValueError, match=r"token ids in \[0, 10\), got range \[0, 10\]"):
        SamplingBatch.build([penalised], [None], [[]], [[0, 10]], 10, "cpu")
