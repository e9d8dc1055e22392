"""Per-request sampling parameters, validated once when the request arrives.

Names follow vLLM / SGLang so that OpenAI-style request bodies map onto them directly.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from dsv3serve.sampling.constraint import Constraint

# Temperatures below this are treated as greedy: dividing logits by them would overflow.
GREEDY_TEMPERATURE_EPS = 1e-5
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for logit_bias values: [-100, 100]
# Seeds are 64-bit signed (vLLM's range); sequence i of n seeds with seed + i, which
# torch.Generator.manual_seed still takes (it accepts [-2**63, 2**64 - 1]).
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1


class SamplingParamsError(ValueError):
    """Invalid sampling parameters.

    The message lists every problem as ``<field>: <what is allowed> (got <value>)``;
    ``field`` names the first offending field.
    """

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


def _reject(allowed: str, field: str = "") -> PydanticCustomError:
    return PydanticCustomError("sampling_param", allowed, {"field": field})


def _field_of(error: Any) -> str:
    located = ".".join(str(part) for part in error["loc"])
    return located or error.get("ctx", {}).get("field", "")


def _describe(error: Any) -> str:
    if not error["loc"]:  # cross-field checks already name their fields and values
        return error["msg"]
    return f"{_field_of(error)}: {error['msg']} (got {error['input']!r})"


class SamplingParams(BaseModel):
    """How to pick the next tokens of one request and when to stop.

    ``temperature == 0`` means greedy decoding; ``top_k`` of -1 or 0 disables top-k;
    ``logprobs`` is the number of top alternatives to return per token (0 returns only
    the sampled token's logprob, ``None`` returns none). ``logit_bias`` maps token ids to
    a value in [-100, 100] added to their logits before sampling (ids are checked against
    the model's vocabulary by the engine). ``constraint`` restricts the output to a
    grammar (structured output; see ``engine/constraint.py``). Constructed with keyword
    arguments, invalid values raise :class:`SamplingParamsError`, a ``ValueError``
    (``model_validate`` raises pydantic's ``ValidationError``, also a ``ValueError``).
    """

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] = {}
    constraint: Constraint | None = None

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            errors = exc.errors()
            message = "invalid SamplingParams: " + "; ".join(_describe(e) for e in errors)
            raise SamplingParamsError(message, _field_of(errors[0])) from None

    @field_validator("n", "max_new_tokens")
    @classmethod
    def _at_least_one(cls, value: int) -> int:
        if value < 1:
            raise _reject("must be >= 1")
        return value

    @field_validator("min_new_tokens")
    @classmethod
    def _non_negative(cls, value: int) -> int:
        if value < 0:
            raise _reject("must be >= 0")
        return value

    @field_validator("seed")
    @classmethod
    def _check_seed(cls, value: int | None) -> int | None:
        if value is not None and not SEED_MIN <= value <= SEED_MAX:
            raise _reject(f"must be a 64-bit signed integer, in [{SEED_MIN}, {SEED_MAX}]")
        return value

    @field_validator("temperature")
    @classmethod
    def _check_temperature(cls, value: float) -> float:
        if value < 0:
            raise _reject("must be >= 0 (0 means greedy)")
        return value

    @field_validator("top_p")
    @classmethod
    def _check_top_p(cls, value: float) -> float:
        if not 0.0 < value <= 1.0:
            raise _reject("must be in (0, 1]")
        return value

    @field_validator("top_k")
    @classmethod
    def _check_top_k(cls, value: int) -> int:
        if value < -1:
            raise _reject("must be -1 or 0 (disabled) or a positive integer")
        return value

    @field_validator("min_p")
    @classmethod
    def _check_min_p(cls, value: float) -> float:
        if not 0.0 <= value <= 1.0:
            raise _reject("must be in [0, 1]")
        return value

    @field_validator("repetition_penalty")
    @classmethod
    def _check_repetition_penalty(cls, value: float) -> float:
        if value <= 0:
            raise _reject("must be > 0 (1 disables it)")
        return value

    @field_validator("frequency_penalty", "presence_penalty")
    @classmethod
    def _check_openai_penalty(cls, value: float) -> float:
        if not -2.0 <= value <= 2.0:
            raise _reject("must be in [-2, 2]")
        return value

    @field_validator("logprobs")
    @classmethod
    def _check_logprobs(cls, value: int | None) -> int | None:
        if value is not None and not 0 <= value <= MAX_TOP_LOGPROBS:
            raise _reject(f"must be None or in [0, {MAX_TOP_LOGPROBS}]")
        return value

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value: list[str]) -> list[str]:
        if any(s == "" for s in value):
            raise _reject("stop strings must be non-empty")
        return value

    @field_validator("stop_token_ids")
    @classmethod
    def _check_stop_token_ids(cls, value: list[int]) -> list[int]:
        if any(t < 0 for t in value):
            raise _reject("token ids must be >= 0")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, value: dict[int, float]) -> dict[int, float]:
        if any(t < 0 for t in value):
            raise _reject("token ids must be >= 0")
        if any(not -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS for b in value.values()):
            raise _reject(f"bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
        return value

    @model_validator(mode="after")
    def _check_constraint_ending(self) -> SamplingParams:
        if self.constraint is None:
            return self
        for name, set_ in (
            ("ignore_eos", self.ignore_eos),
            ("min_new_tokens", self.min_new_tokens > 0),
        ):
            if set_:
                raise _reject(
                    f"{name} cannot be combined with a structured-output constraint: "
                    "the constraint ends the output when its structure is complete",
                    field=name,
                )
        return self

    @model_validator(mode="after")
    def _check_token_budget(self) -> SamplingParams:
        if self.min_new_tokens > self.max_new_tokens:
            raise _reject(
                f"min_new_tokens ({self.min_new_tokens}) must be <= "
                f"max_new_tokens ({self.max_new_tokens})",
                field="min_new_tokens",
            )
        return self

    @property
    def is_greedy(self) -> bool:
        """True when the next token is the argmax (temperature 0, or below 1e-5)."""
        return self.temperature < GREEDY_TEMPERATURE_EPS

    @property
    def top_k_enabled(self) -> bool:
        """True when top-k filtering is active (``top_k >= 1``)."""
        return self.top_k >= 1

    @property
    def has_penalties(self) -> bool:
        """True when any of the repetition / frequency / presence penalties is active."""
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )
