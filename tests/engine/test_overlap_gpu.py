"""Overlap scheduler on a GPU: flashinfer attention, Triton MoE and decode CUDA graphs.

The overlapped engine (the CUDA default) must give the tokens of the same engine with
``disable_overlap_schedule``, replay graphs with placeholder input ids, and free every page.
Also ``enable_torch_compile`` on the same tiny checkpoint.
"""

from __future__ import annotations

import random

import pytest
from attention_cases import DEEPSEEK_ATTENTION

pytestmark = pytest.mark.gpu
pytest.importorskip("flashinfer")

from dsv3serve.engine.config import EngineConfig  # noqa: E402
from dsv3serve.engine.engine import Engine  # noqa: E402
from dsv3serve.engine.request import Request  # noqa: E402
from dsv3serve.model.tiny import make_tiny_checkpoint  # noqa: E402
from dsv3serve.sampling.sampling_params import SamplingParams  # noqa: E402

PAGE = 64
MAX_BS = 8


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory):
    return make_tiny_checkpoint(
        tmp_path_factory.mktemp("tiny_overlap"), fp8=True, overrides=DEEPSEEK_ATTENTION
    )


def _engine(ckpt, **kw) -> Engine:
    return Engine(
        EngineConfig(
            model=str(ckpt),
            device="cuda",
            dtype="bfloat16",
            attention_backend="flashinfer",
            moe_backend="triton",
            page_size=PAGE,
            num_kv_tokens=64 * PAGE,
            cuda_graph_max_bs=MAX_BS,
            max_running_requests=MAX_BS,
            **kw,
        )
    )


@pytest.fixture(scope="module")
def engines(ckpt) -> tuple[Engine, Engine]:
    overlapped, plain = _engine(ckpt), _engine(ckpt, disable_overlap_schedule=True)
    assert overlapped.overlap and not plain.overlap
    assert overlapped.runner.graphs is not None
    return plain, overlapped


def _run(engine: Engine, requests: list[Request]) -> dict[str, tuple[list[int], str | None]]:
    for req in requests:
        engine.add_request(req)
    out: dict[str, tuple[list[int], str | None]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            tokens, _ = out.get(o.request_id, ([], None))
            out[o.request_id] = (tokens + o.token_ids, o.finish_reason)
    kv = engine.scheduler.kv
    kv.evict_all()
    assert kv.free_pages == kv.num_pages
    return out


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, 100000) for _ in range(rng.randint(3, 200))] for _ in range(n)]


def test_uniform_batch_gives_identical_greedy_tokens(engines) -> None:
    """Every request ends on the same step, so both engines run the same batches: the
    tokens must be identical, and the overlapped decode steps replay graphs."""
    plain, overlapped = engines
    params = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)

    def make() -> list[Request]:
        return [Request(f"u{i}", params, prompt_ids=p) for i, p in enumerate(_prompts(6, 1))]

    replays = overlapped.runner.graphs.replays
    got = _run(overlapped, make())
    assert overlapped.runner.graphs.replays - replays >= 10
    assert got == _run(plain, make())


def test_mixed_lengths_stops_and_seeds_match(engines) -> None:
    """Different lengths, a stop token and seeded sampling: batch shapes differ between the
    two engines (a finishing sequence rides one extra overlapped step), so a random bf16
    model may flip a near-tie; lengths and finish reasons must match, tokens nearly all."""
    plain, overlapped = engines
    prompts = _prompts(8, 2)
    ref = _run(
        plain,
        [Request("ref", SamplingParams(temperature=0, max_new_tokens=6), prompt_ids=prompts[0])],
    )["ref"][0]

    def make() -> list[Request]:
        kinds = [
            SamplingParams(temperature=0, max_new_tokens=3 + i, ignore_eos=True) for i in range(5)
        ] + [
            SamplingParams(temperature=0, max_new_tokens=9, stop_token_ids=[ref[2]]),
            SamplingParams(temperature=0.8, seed=5, max_new_tokens=7, ignore_eos=True),
            SamplingParams(temperature=0.8, seed=6, max_new_tokens=5, logprobs=2),
        ]
        return [
            Request(f"m{i}", k, prompt_ids=p)
            for i, (k, p) in enumerate(zip(kinds, prompts, strict=True))
        ]

    got, want = _run(overlapped, make()), _run(plain, make())
    assert got.keys() == want.keys()
    fixed = [f"m{i}" for i in (0, 1, 2, 3, 4, 6)]  # ignore_eos: the length is max_new_tokens
    assert [len(got[k][0]) for k in fixed] == [len(want[k][0]) for k in fixed]
    same = sum(got[k] == want[k] for k in want)
    print(f"overlap vs plain identical completions: {same}/{len(want)}")
    assert same >= len(want) - 1


@pytest.mark.xfail(
    reason="H200, 2026-11-24: the compiled decode ran (Triton kernels kept out of the graph) "
    "but its greedy tokens differed from the uncompiled engine's in 2 of 2 completions, and "
    "dynamo hit its recompile limit; not yet explained, so --enable-torch-compile stays off",
    strict=True,  # an unexpected pass fails, so a fix is noticed and this mark removed
)
def test_torch_compile_decode_matches_eager(ckpt, engines) -> None:
    """``enable_torch_compile`` compiles the captured decode forward (sizes 1 and 2 here;
    max-autotune makes each compile slow, so the batch stays at 2)."""
    plain, _ = engines
    compiled = _engine(ckpt, enable_torch_compile=True, torch_compile_max_bs=2)
    params = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)

    def make() -> list[Request]:
        return [Request(f"c{i}", params, prompt_ids=p) for i, p in enumerate(_prompts(2, 3))]

    replays = compiled.runner.graphs.replays
    got, want = _run(compiled, make()), _run(plain, make())
    assert compiled.runner.graphs.replays - replays >= 7
    same = sum(got[k] == want[k] for k in want)
    print(f"compiled vs uncompiled identical completions: {same}/{len(want)}")
    assert same >= len(want) - 1
