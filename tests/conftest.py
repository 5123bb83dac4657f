"""Shared fixtures."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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
    has (in-flight weights too). One run for the whole test run: tests damage or resume copies of it."""
    from roundpipe.cli import main
    from tests.helpers import train_args

    out = tmp_path_factory.mktemp("runs")
    assert main(train_args(model_config, out, "good", 2)) == 0
    return out / "good" / "checkpoint"


@pytest.fixture(scope="session", autouse=True)
def distributed_train_runs(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Any]:
    """The processes of tests/test_distributed_train.py's runs, started before the first test so
    they run beside the suite (tests/distributed_train_runs.py); None when no selected test needs
    them."""
    items = [item for item in request.session.items if item.path.name == "test_distributed_train.py"]
    if not any("runs" in getattr(item, "fixturenames", ()) for item in items):
        yield None
        return
    from tests import distributed_train_runs as runs

    elastic = any(item.name == runs.ELASTIC_TEST for item in items)
    model = request.getfixturevalue("model_config")
    started = runs.start_runs(model, tmp_path_factory.mktemp("train"), elastic)
    yield started
    runs.stop(started)


@pytest.fixture(scope="session", autouse=True)
def distributed_workers(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Any]:
    """The two processes of tests/test_distributed.py, started before the first test from a
    thread of lower priority (as the train runs above), so their interpreters start and train on
    the core the suite leaves idle; None when no selected test needs them."""
    items = [item for item in request.session.items if item.path.name == "test_distributed.py"]
    if not any("run" in getattr(item, "fixturenames", ()) for item in items):
        yield None
        return
    from tests import distributed_train_runs as runs
    from tests.test_distributed import start_workers

    out = tmp_path_factory.mktemp("distributed")
    started: list[Any] = []

    def launch() -> None:
        runs.lower_this_threads_priority()
        started.extend(start_workers(out))

    launcher = threading.Thread(target=launch, name="start the distributed workers", daemon=True)
    launcher.start()
    launcher.join()  # Popen returns at once; the thread only gives the processes its priority
    yield out, started
    for proc in started:
        if proc.poll() is None:
            proc.kill()


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


def _freeze_the_heap() -> None:
    """Take every object alive now out of the cyclic collector's view (``gc.freeze``), after
    collecting the garbage. Most of a test process's heap is torch, transformers, hypothesis and
    the test modules, never garbage; every full collection re-scanned all of it, and tests that
    allocate many objects (the engine simulating thousands of tasks) spent more time in those
    scans than in their own work: the exhaustive plan search ran 2x slower here than in a bare
    process. Nothing a test checks changes; objects made later are collected as before."""
    gc.collect()
    gc.freeze()


def pytest_collection_finish(session: pytest.Session) -> None:
    _freeze_the_heap()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """After a module's last test (its module fixtures are gone then): what its tests imported
    lazily (transformers' model code, dynamo) joins the frozen heap."""
    result = yield
    if nextitem is None or getattr(nextitem, "module", None) is not getattr(item, "module", None):
        _freeze_the_heap()
    return result
