"""Shared fixtures: tiny checkpoints written once per session, and model helpers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dsv3serve.model.tiny import make_tiny_checkpoint


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """GPU tests skip cleanly where there is no CUDA device."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_bf16_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_bf16"), fp8=False)


@pytest.fixture(scope="session")
def tiny_fp8_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_fp8"), fp8=True)
