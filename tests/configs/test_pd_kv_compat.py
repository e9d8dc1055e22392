"""PD between layouts at config time (workers/pd_compat.py): the parallel layouts of
prefill and decode may differ, the KV page format may not, and a mismatch is refused when
the serving config is validated, naming each differing field with both values."""

from __future__ import annotations

from typing import Any

import pytest

from dsv3serve.engine.config import EngineConfig
from dsv3serve.engine.model_runner import resolve_dtype
from router.config import ConfigError, ServingConfig
from router.launch import local_pd_config
from workers.pd_compat import kv_storage_dtype

DP2_EP2 = {"tp_size": 2, "dp_size": 2, "enable_dp_attention": True, "ep_size": 2}


def pd_args(**change: Any) -> dict[str, Any]:
    return {**local_pd_config()["applications"][0]["args"], **change}


@pytest.mark.parametrize(
    ("prefill", "decode"),
    [({"tp_size": 2}, DP2_EP2), ({}, DP2_EP2), ({"tp_size": 2, "ep_size": 2}, {})],
)
def test_different_parallel_layouts_are_accepted(prefill: dict, decode: dict) -> None:
    cfg = ServingConfig.parse(pd_args(prefill={"engine": prefill}, decode={"engine": decode}))
    assert cfg.worker_config("decode").engine.tp_size == decode.get("tp_size", 1)


@pytest.mark.parametrize(
    ("prefill", "decode", "message"),
    [
        ({"page_size": 32}, {}, r"engine\.page_size: prefill 32, decode 16"),
        (
            {},
            {"kv_cache_dtype": "fp8_e4m3"},
            r"KV storage dtype \(engine\.kv_cache_dtype, engine\.dtype, engine\.device\): "
            r"prefill 'float32', decode 'float8_e4m3fn'",
        ),
        ({"dtype": "bfloat16"}, {}, r"prefill 'bfloat16', decode 'float32'"),
        ({"hf_overrides": {"num_hidden_layers": 3}}, {}, r"engine\.hf_overrides: prefill \{"),
    ],
)
def test_kv_page_format_differences_are_refused_naming_the_fields(
    prefill: dict, decode: dict, message: str
) -> None:
    args = pd_args(prefill={"engine": prefill}, decode={"engine": decode})
    with pytest.raises(ConfigError, match=message) as info:
        ServingConfig.parse(args)
    assert "Set these in the shared `engine` section" in str(info.value)


def test_every_difference_is_named_at_once() -> None:
    args = pd_args(prefill={"engine": {"page_size": 32, "kv_cache_dtype": "fp8_e4m3"}})
    with pytest.raises(ConfigError) as info:
        ServingConfig.parse(args)
    assert "engine.page_size: prefill 32, decode 16" in str(info.value)
    assert "prefill 'float8_e4m3fn', decode 'float32'" in str(info.value)


def test_the_shared_engine_section_changes_both_roles_alike() -> None:
    engine = {"model": "tiny", "page_size": 32, "kv_cache_dtype": "fp8_e4m3"}
    cfg = ServingConfig.parse(pd_args(engine=engine))
    assert cfg.worker_config("prefill").engine.page_size == 32


def test_colocated_mode_has_no_pd_check() -> None:
    cfg = ServingConfig.parse(pd_args(mode="colocated", prefill={"engine": {"page_size": 32}}))
    assert cfg.roles() == ("colocated",)


@pytest.mark.parametrize(
    ("fields", "dtype"),
    [
        ({}, "float32"),
        ({"device": "cuda:1"}, "bfloat16"),
        ({"dtype": "bfloat16"}, "bfloat16"),
        ({"device": "cuda", "dtype": "float32"}, "float32"),
        ({"kv_cache_dtype": "fp8_e4m3"}, "float8_e4m3fn"),
    ],
)
def test_kv_storage_dtype_follows_the_model_runner(fields: dict, dtype: str) -> None:
    """The runner's pool dtype (``resolve_dtype`` unless fp8), computed without torch."""
    engine = EngineConfig(model="tiny", **fields)
    assert kv_storage_dtype(engine) == dtype
    if engine.kv_cache_dtype == "auto":
        assert str(resolve_dtype(engine)) == f"torch.{dtype}"


@pytest.mark.parametrize("reuse", [True, False])
def test_decode_prefix_reuse_reaches_every_worker_config(reuse: bool) -> None:
    cfg = ServingConfig.parse(pd_args(decode_prefix_reuse=reuse))
    assert cfg.worker_config("decode").decode_prefix_reuse is reuse
