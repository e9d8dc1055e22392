"""Offline batch generation: ``LLM(model).generate(prompts, params)``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dsv3serve.engine.config import EngineConfig
from dsv3serve.engine.engine import Engine
from dsv3serve.engine.request import Request
from dsv3serve.engine.sampling_params import SamplingParams


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
    """Runs a list of prompts to completion through the continuous-batching engine."""

    def __init__(self, model: str, **engine_args: Any) -> None:
        self.engine = Engine(EngineConfig(model=model, **engine_args))

    def generate(
        self,
        prompts: list[str] | list[list[int]],
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
