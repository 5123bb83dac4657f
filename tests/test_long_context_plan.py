"""One sequence per iteration: what the plan counts in flight, and the 8B shape at 262,144 tokens.

The per-token figures below are what `bench/long_context_memory.py` measures on the CPU for a
sliced Llama layer (hidden-sized tensors per token: saved 2.56, forward working set 2.0,
backward working set 3.0); fixed here so the test stays fast and deterministic."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

import roundpipe
from roundpipe.plan.costs import LayerCosts
from roundpipe.plan.in_flight import in_flight_microbatches
from roundpipe.plan.memory import layer_plan_bytes, predict_peak
from roundpipe.planning.device_plan import plan_from

ROOT = Path(__file__).resolve().parents[1]
GIB = 1 << 30
MEASURED = {"saved": (2.562, 0.0), "work": (2.0, 0.0), "bwd_work": (3.0, 0.0)}


def _script() -> ModuleType:
    sys.path.append(str(ROOT / "bench"))
    spec = importlib.util.spec_from_file_location(
        "long_context_memory", ROOT / "bench" / "long_context_memory.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _plan(tokens: int, microbatches: int, budget: int | None) -> tuple[object, object, object]:
    script = _script()
    memory = script.layer_memory(tokens, MEASURED, "bf16")
    layers = memory.num_layers
    costs = LayerCosts(
        fwd_ms=(1.0, *[1000.0] * (layers - 2), 40.0),
        bwd_ms=(1.0, *[2500.0] * (layers - 2), 80.0),
        mem_bytes=layer_plan_bytes(memory, "layer"),
    )
    config = roundpipe.RunConfig(
        devices="cpu:1", num_microbatches=microbatches, recompute_grain="layer", precision="bf16"
    )
    return plan_from(config, costs, memory, 1, budget, "cuda"), memory, config


def test_in_flight_never_counts_more_microbatches_than_the_iteration_has() -> None:
    assert [in_flight_microbatches(m) for m in (1, 2, 3, 16)] == [1, 2, 2, 2]


def test_one_sequence_of_262144_tokens_on_the_8b_shape_plans_under_24_gib() -> None:
    device_plan, memory, _ = _plan(262144, 1, 24 * GIB)
    peak = device_plan.prediction.peak_bytes  # type: ignore[attr-defined]
    assert 17 * GIB < peak <= 21 * GIB  # the planning share of 24 GiB on CUDA
    # Counting two microbatches in flight, as before, the same plan would not fit.
    plan = device_plan.plan  # type: ignore[attr-defined]
    assert predict_peak(plan, memory, "layer", act_in_flight=2).peak_bytes > 23 * GIB


@pytest.mark.parametrize("tokens", [131072, 262144])
def test_the_block_figures_are_linear_in_tokens(tokens: int) -> None:
    memory = _script().layer_memory(tokens, MEASURED, "bf16")
    unit = tokens * 4096 * 2
    assert memory.saved_bytes[1] == pytest.approx(2.562 * unit, rel=1e-6)
    # The backward adds flash attention's fp32 query-gradient accumulator of one KV group.
    assert memory.bwd_work_bytes[1] == pytest.approx(3.0 * unit + tokens * 512 * 4, rel=1e-6)


def test_the_profile_warms_up_each_kind_of_layer_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Identical decoder layers share one warm-up (at 262,144 tokens each is a full forward and
    backward); a layer of another shape or input size gets its own."""
    import torch
    from torch import nn

    from roundpipe.backends import profile

    warmed: list[int] = []
    real = profile._warm_up
    monkeypatch.setattr(
        profile, "_warm_up", lambda call, x, i, *rest: (warmed.append(i), real(call, x, i, *rest))
    )
    layers = [
        nn.Linear(8, 8),
        nn.Linear(8, 8),
        nn.Linear(8, 8),
        nn.Linear(8, 4),
        nn.Linear(4, 4),
        nn.Linear(4, 4),
    ]
    found = profile.measure_layers(layers, torch.randn(2, 8), torch.device("cpu"), computes_loss=False)
    assert warmed == [0, 3, 4] and len(found) == 6
