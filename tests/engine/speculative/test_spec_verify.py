"""Draft verification (``speculative/verify.py``) on fresh random inputs.

Greedy: against a plain-Python prefix match. Rejection sampling: the committed tokens
must follow the target's distribution whatever the draft proposes. Each check draws
``N = 200_000`` rounds over a vocabulary of 6 and runs a chi-square goodness-of-fit test
at alpha = 1e-4 (5 degrees of freedom: critical value 25.74), so a correct sampler fails
a fresh seed with probability 1e-4 per check; every check also shows the test would
reject the textbook mistake of drawing the correction from ``p`` instead of
``norm(max(p - q, 0))``. With the seeds fixed here the outcome is deterministic.
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from dsv3serve.engine.speculative.verify import accepted_prefix, greedy_verify, rejection_verify

N, V = 200_000, 6
ALPHA = 1e-4


def random_probs(g: torch.Generator, *shape: int) -> torch.Tensor:
    """Rows on the simplex with some zeros, like top-k-filtered targets."""
    w = torch.rand(*shape, V, generator=g) ** 2
    w[..., 0] = 0.0  # token 0 is always filtered out
    return w / w.sum(-1, keepdim=True)


def draws(g: torch.Generator, b: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.rand(b, k, generator=g), torch.empty(b, V).exponential_(generator=g)


def assert_follows(samples: torch.Tensor, probs: torch.Tensor, wrong: torch.Tensor) -> None:
    """``samples`` fit ``probs`` (not rejected at ALPHA) and clearly do not fit ``wrong``."""
    observed = torch.bincount(samples, minlength=V).double()
    keep = probs > 0
    assert observed[~keep].sum() == 0, "sampled a token of probability 0"
    assert chisquare(observed[keep], scaled(probs[keep], observed)).pvalue > ALPHA
    assert chisquare(observed[keep], scaled(wrong[keep], observed)).pvalue < 1e-12


def scaled(weights: torch.Tensor, observed: torch.Tensor) -> torch.Tensor:
    """Expected counts: ``weights`` normalised (in float64) to the observed total."""
    w = weights.double()
    return w / w.sum() * observed.sum()


def test_accepted_prefix_stops_at_first_reject_and_at_num_drafts() -> None:
    accept = torch.tensor([[1, 1, 0, 1], [1, 1, 1, 1], [0, 1, 1, 1], [1, 1, 1, 1]]).bool()
    got = accepted_prefix(accept, torch.tensor([4, 4, 4, 2]))
    assert got.tolist() == [2, 4, 0, 2]


def test_greedy_verify_matches_python_prefix_match() -> None:
    g = torch.Generator().manual_seed(0)
    b, k = 500, 5
    target = torch.randint(0, 4, (b, k + 1), generator=g)
    drafts = torch.where(torch.rand(b, k, generator=g) < 0.8, target[:, :k], 3 - target[:, :k])
    num_drafts = torch.randint(0, k + 1, (b,), generator=g)
    num_accepted, tokens = greedy_verify(target, drafts, num_drafts)
    for row in range(b):
        n = 0
        while n < num_drafts[row] and drafts[row, n] == target[row, n]:
            n += 1
        assert num_accepted[row] == n
        assert tokens[row, : n + 1].tolist() == target[row, : n + 1].tolist()


def test_rejection_with_deterministic_draft_commits_the_target_distribution() -> None:
    """Drafts fixed at (d1, d2): token 1 ~ p0; given token 1 = d1, token 2 ~ p1; and so on."""
    g = torch.Generator().manual_seed(1)
    p = random_probs(g, 3)  # p0, p1, p2
    d = torch.tensor([int(p[0].argmax()), 1 + int(p[1][1:].argmin())])  # likely, unlikely
    target = p.expand(N, 3, V)
    num_accepted, tokens = rejection_verify(
        target, d.expand(N, 2), torch.full((N,), 2), *draws(g, N, 2)
    )
    first, second = tokens[:, 0], tokens[:, 1]
    naive = p[0].clone()
    naive[d[0]] += p[0][d[0]] * (1 - p[0][d[0]])  # correction drawn from p, not p - q
    assert_follows(first, p[0], naive)
    assert torch.equal(num_accepted >= 1, first == d[0])  # one-hot q: d1 only if accepted
    wrong1 = p[1].clone()
    wrong1[d[1]] += 0.2  # accepting d2 too often
    assert_follows(second[num_accepted >= 1], p[1], wrong1)
    wrong2 = torch.ones(V)
    assert_follows(tokens[num_accepted == 2, 2], p[2], wrong2)


def test_rejection_with_a_sampled_draft_commits_the_target_distribution() -> None:
    """Draft tokens drawn from the draft's own q (general q, not one-hot)."""
    g = torch.Generator().manual_seed(2)
    p, q = random_probs(g, 2), torch.rand(V, generator=g) + 0.05
    q = q / q.sum()
    drafts = torch.multinomial(q, N, replacement=True, generator=g).unsqueeze(1)
    _, tokens = rejection_verify(
        p.expand(N, 2, V),
        drafts,
        torch.ones(N, dtype=torch.long),
        *draws(g, N, 1),
        q.expand(N, 1, V),
    )
    naive = torch.minimum(p[0], q) + (1 - torch.minimum(p[0], q).sum()) * p[0]
    assert_follows(tokens[:, 0], p[0], naive)


def test_rejection_ignores_padding_and_handles_no_drafts() -> None:
    g = torch.Generator().manual_seed(3)
    p = random_probs(g, 3)
    d = p.argmax(-1)[:2]
    p_certain = torch.zeros(3, V)
    p_certain[0, d[0]] = p_certain[1, d[1]] = p_certain[2, 1] = 1.0
    # num_drafts 1: the second draft is padding and never accepted, even if certain
    num_accepted, tokens = rejection_verify(
        p_certain.expand(4, 3, V), d.expand(4, 2), torch.ones(4, dtype=torch.long), *draws(g, 4, 2)
    )
    assert num_accepted.tolist() == [1] * 4 and (tokens[:, 1] == d[1]).all()
    num_accepted, tokens = rejection_verify(
        p[:1].expand(N, 1, V), torch.empty(N, 0, dtype=torch.long), torch.zeros(N), *draws(g, N, 0)
    )
    assert num_accepted.eq(0).all() and tokens.shape == (N, 1)
    assert_follows(tokens[:, 0], p[0], torch.ones(V))


@pytest.mark.parametrize("seed", [4, 5])
def test_rejection_never_returns_a_filtered_token(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    p = random_probs(g, 1000, 4)
    drafts = torch.randint(0, V, (1000, 3), generator=g)  # token 0 has p = 0: rejected
    num_accepted, tokens = rejection_verify(p, drafts, torch.full((1000,), 3), *draws(g, 1000, 3))
    picked = p[torch.arange(1000)[:, None], torch.arange(4), tokens]
    committed = torch.arange(4) <= num_accepted[:, None]
    assert (picked[committed] > 0).all()
