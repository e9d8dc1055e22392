"""The ``generated-shared-prefix`` workload: groups of prompts that share a system prompt.

SGLang's dataset of that name is the model: ``gsp_num_groups`` random system prompts of
``gsp_system_prompt_len`` tokens, each followed by ``gsp_prompts_per_group`` random
questions of ``gsp_question_len`` tokens (one text: system prompt, a blank line, the
question), asking ``gsp_output_len`` tokens each, in an order shuffled by ``seed``. Every
prompt after the first of its group can reuse the group's prefix from a prefix cache.
"""

from __future__ import annotations

import random

from dsv3serve.bench.serve.config import BenchServeConfig
from dsv3serve.bench.serve.prompts import BenchRequest, exact_prompt
from dsv3serve.tokenizer.tokenizer import Tokenizer


def _question(tokenizer: Tokenizer, rng: random.Random, length: int) -> str:
    """Random text of ``length`` tokens (no BOS)."""
    return exact_prompt(tokenizer, rng, length + 1)


def shared_prefix_requests(config: BenchServeConfig, tokenizer: Tokenizer) -> list[BenchRequest]:
    """``gsp_num_groups * gsp_prompts_per_group`` requests, shuffled; ``prompt_len`` counts
    each whole text's tokens with BOS (the seam may merge a token or two)."""
    rng = random.Random(config.seed)
    requests = []
    for _ in range(config.gsp_num_groups):
        system = exact_prompt(tokenizer, rng, config.gsp_system_prompt_len)
        for _ in range(config.gsp_prompts_per_group):
            text = f"{system}\n\n{_question(tokenizer, rng, config.gsp_question_len)}"
            length = len(tokenizer.encode(text, add_bos=True))
            requests.append(BenchRequest(text, length, config.gsp_output_len))
    rng.shuffle(requests)
    return requests
