"""Offline batch generation: ``LLM(model).generate(prompts, params)``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from dsv3serve.engine.config import EngineConfig
from dsv3serve.engine.engine import Engine
from dsv3serve.engine.group.local import LocalGroup, rank_config, spawn_followers
from dsv3serve.engine.group.rank import attach_leader
from dsv3serve.engine.request import Request
from dsv3serve.sampling.sampling_params import SamplingParams


@dataclass
class CompletionOutput:
    """One of the ``n`` completions of a prompt."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[float] = field(default_factory=list)


@dataclass
class RequestOutput:
    """All completions of one prompt."""

    request_id: str
    num_prompt_tokens: int
    outputs: list[CompletionOutput]
    cached_tokens: int = 0


class LLM:
    """Runs a list of prompts to completion through the continuous-batching engine.

    With ``tp_size > 1`` it starts the group's other ranks as processes on this host (gloo
    on CPU, NCCL with one GPU per rank) and drives them as one engine; :meth:`close` (or
    leaving a ``with`` block) stops them.
    """

    def __init__(self, model: str, **engine_args: Any) -> None:
        self._start(EngineConfig(model=model, **engine_args))

    @classmethod
    def from_config(cls, cfg: EngineConfig) -> LLM:
        """An LLM over a validated EngineConfig (the CLI's flags)."""
        llm = cls.__new__(cls)
        llm._start(cfg)
        return llm

    def _start(self, cfg: EngineConfig) -> None:
        self._group: LocalGroup | None = None
        self._leader: Any = None
        if cfg.tp_size > 1:
            self._group = spawn_followers(cfg)
            cfg = rank_config(cfg, 0)
        self.engine = Engine(cfg)
        if self._group is not None:
            self._leader = attach_leader(self.engine)

    def close(self) -> None:
        """Stop the group's other ranks (nothing to do on one rank)."""
        if self._group is not None:
            self._leader.stop()
            self._group.join()
            self._group = None

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if exc_type is None or self._group is None:
            self.close()
            return
        # rank 0 failed mid-step: its followers may wait in a collective it will never join,
        # so STOP cannot reach them; kill them and let the original error propagate
        self._group.kill()
        self._group = None

    def generate(
        self,
        prompts: Sequence[str | list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text, or token ids); results in prompt order."""
        params = sampling_params or SamplingParams()
        per_prompt = params if isinstance(params, list) else [params] * len(prompts)
        results: dict[str, RequestOutput] = {}
        for i, (prompt, p) in enumerate(zip(prompts, per_prompt, strict=True)):
            rid = f"offline-{i}"
            req = (
                Request(rid, p, prompt=prompt)
                if isinstance(prompt, str)
                else Request(rid, p, prompt_ids=list(prompt))
            )
            self.engine.add_request(req)
            results[rid] = RequestOutput(rid, 0, [CompletionOutput(j) for j in range(p.n)])
        while self.engine.has_unfinished():
            for out in self.engine.step():
                res = results[out.request_id]
                comp = res.outputs[out.index]
                comp.text += out.text
                comp.token_ids += out.token_ids
                comp.logprobs += out.logprobs
                res.cached_tokens = max(res.cached_tokens, out.cached_tokens)
                res.num_prompt_tokens = out.prompt_tokens
                if out.finished:
                    comp.finish_reason = out.finish_reason
        return list(results.values())
