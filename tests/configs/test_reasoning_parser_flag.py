"""``--reasoning-parser`` / ``router.reasoning_parser``: SGLang's names, checked up front."""

from __future__ import annotations

import pytest

from dsv3serve.cli import build_parser
from router.config import ConfigError, ServingConfig
from router.launch import local_pd_config, with_reasoning_parser


def test_flag_sets_every_app_and_leaves_the_file_alone() -> None:
    args = build_parser().parse_args(["serve", "--reasoning-parser", "deepseek-r1"])
    data = local_pd_config()
    changed = with_reasoning_parser(data, args.reasoning_parser)
    app_args = changed["applications"][0]["args"]
    assert ServingConfig.parse(app_args).router.reasoning_parser == "deepseek-r1"
    assert app_args["router"]["served_model_name"] == "deepseek-v3-tiny"  # others kept
    assert "reasoning_parser" not in data["applications"][0]["args"]["router"]
    assert with_reasoning_parser(data, None) is data
    default = build_parser().parse_args(["serve"])
    assert default.reasoning_parser is None


def test_unknown_parser_names_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--reasoning-parser", "qwen3"])
    assert "deepseek-r1" in capsys.readouterr().err
    args = local_pd_config()["applications"][0]["args"]
    args["router"]["reasoning_parser"] = "r1"
    with pytest.raises(ConfigError, match="router.reasoning_parser"):
        ServingConfig.parse(args)
