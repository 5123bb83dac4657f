"""Shared fixtures."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.helpers import tiny_causal_lm_config


@pytest.fixture(scope="session")
def model_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3 config file, as `roundpipe train --model` takes it (read, never written)."""
    path = tmp_path_factory.mktemp("model") / "config.json"
    tiny_causal_lm_config("qwen3", vocab=256).to_json_file(str(path))
    return path


@pytest.fixture(scope="session")
def good_checkpoint(model_config: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The checkpoint of a 2-step async `roundpipe train` run: every kind of file a checkpoint
    has (in-flight weights too). One run for the session: tests damage or resume copies of it."""
    from roundpipe.cli import main
    from tests.helpers import train_args

    out = tmp_path_factory.mktemp("runs")
    assert main(train_args(model_config, out, "good", 2)) == 0
    return out / "good" / "checkpoint"


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """Tiny models gain nothing from threads, and one thread stays fast on a shared, busy CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``gpu`` need CUDA; without it they are skipped, never failed."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
