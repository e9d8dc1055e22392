"""The MTP draft state on the wire: tensor <-> DraftHandoff <-> JSON, bit for bit."""

from __future__ import annotations

import json

import pytest
import torch
from pydantic import ValidationError

from dsv3serve.engine.speculative.loop import DraftState
from dsv3serve.sampling.sampling_params import SamplingParams
from kv_transfer.handle import KVHandle
from workers.draft_wire import (
    DraftMismatchError,
    draft_from_wire,
    draft_to_wire,
    tensor_from_bytes,
    tensor_to_bytes,
)
from workers.protocol import (
    DecodeRequest,
    DraftHandoff,
    GenerateRequest,
    PrefillResult,
    TokenChunk,
    decode,
    encode,
)

HIDDEN = 7168  # DeepSeek-V3's hidden_size
INT_VIEW = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def every_bit_pattern(dtype: torch.dtype, n: int = HIDDEN, seed: int = 0) -> torch.Tensor:
    """Random raw bits as ``dtype``: NaN payloads, infinities, -0.0 and subnormals too."""
    ints = INT_VIEW[dtype]
    info = torch.iinfo(ints)
    gen = torch.Generator().manual_seed(seed)
    bits = torch.randint(info.min, info.max, (n,), dtype=ints, generator=gen)
    special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan")], dtype=dtype)
    return torch.cat([special, bits.view(dtype)])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(INT_VIEW[a.dtype]), b.view(INT_VIEW[b.dtype]))


def through_json(draft: DraftHandoff) -> DraftHandoff:
    """Prefill result -> router -> decode request, each crossing as JSON bytes."""
    handle = KVHandle(
        request_id="r",
        connector="shm",
        num_tokens=3,
        num_pages=1,
        page_size=16,
        num_layers=4,
        kv_dim=576,
        dtype="bfloat16",
        nbytes=4 * 16 * 576 * 2,
    )
    first = TokenChunk(request_id="r", token_ids=[5])
    result = decode(PrefillResult, encode(PrefillResult(first=first, kv=handle, draft=draft)))
    req = GenerateRequest(request_id="r", prompt_ids=[1, 2, 3], params=SamplingParams())
    msg = DecodeRequest(request=req, first_token=5, kv=handle, draft=result.draft)
    received = decode(DecodeRequest, encode(msg)).draft
    assert received is not None
    return received


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_round_trip_through_json_is_bit_exact(dtype: torch.dtype) -> None:
    hidden = every_bit_pattern(dtype)
    wire = through_json(draft_to_wire(DraftState(4, 99, hidden)))
    assert (wire.token, wire.shape) == (99, [hidden.numel()])
    state = draft_from_wire(wire, 4, hidden.numel(), dtype, "cpu")
    assert state.num_tokens == 4 and state.token == 99
    assert same_bits(state.hidden, hidden)


def test_bytes_are_the_tensors_own_little_endian() -> None:
    t = torch.tensor([1.0, -2.0], dtype=torch.bfloat16)
    assert tensor_to_bytes(t) == b"\x80\x3f\x00\xc0"
    back = tensor_from_bytes(tensor_to_bytes(t), torch.bfloat16, [2])
    assert same_bits(back, t)


def test_strided_tensor_is_sent_in_c_order() -> None:
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()[1]  # stride 4
    assert tensor_from_bytes(tensor_to_bytes(t), torch.float32, [3]).tolist() == [1.0, 5.0, 9.0]


def test_decode_side_casts_to_its_own_dtype_and_device() -> None:
    hidden = torch.randn(64, dtype=torch.bfloat16)
    state = draft_from_wire(draft_to_wire(DraftState(2, 7, hidden)), 2, 64, torch.float32, "cpu")
    assert state.hidden.dtype == torch.float32 and torch.equal(state.hidden, hidden.float())


def test_another_models_hidden_size_is_refused_naming_both() -> None:
    wire = draft_to_wire(DraftState(2, 7, torch.zeros(64)))
    with pytest.raises(DraftMismatchError, match=r"found shape \[64\], expected \[7168\]"):
        draft_from_wire(wire, 2, HIDDEN, torch.float32, "cpu")


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"hidden": "AAAA"}, "hidden: found 3 bytes, expected 8 for float32 of shape"),
        ({"hidden": "!!not base64!!"}, "hidden"),
        ({"dtype": "float64"}, "dtype"),
        ({"shape": [0]}, r"shape: found \[0\], expected positive sizes"),
        ({"shape": []}, "shape"),
        ({"token": -1}, "token"),
        ({"extra": 1}, "extra"),
    ],
)
def test_malformed_draft_state_is_rejected_naming_the_field(fields: dict, message: str) -> None:
    good = json.loads(draft_to_wire(DraftState(2, 7, torch.zeros(2))).model_dump_json())
    assert good["hidden"] == "AAAAAAAAAAA="  # 8 zero bytes, base64
    with pytest.raises(ValidationError, match=message):
        DraftHandoff.model_validate_json(json.dumps({**good, **fields}))
