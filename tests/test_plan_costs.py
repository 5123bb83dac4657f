"""Layer costs: conversion, stage sums, validation that names the layer, JSON."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from roundpipe.errors import PlanError
from roundpipe.plan import LayerCosts


def test_costs_convert_lists_and_sum_stages() -> None:
    c = LayerCosts([1, 2.5, 3], [2, 5, 6.5], [10, 20, 30], ["a", "b", "c"])
    assert c.fwd_ms == (1.0, 2.5, 3.0) and isinstance(c.fwd_ms, tuple)
    assert c.mem_bytes == (10, 20, 30) and c.names == ("a", "b", "c")
    assert c.num_layers == 3
    assert c.fwd_stage_ms(range(1, 3)) == 5.5
    assert c.bwd_stage_ms(range(0, 2)) == 1 + 2.5 + 2 + 5
    assert c.fused_stage_ms(range(2, 3)) == 9.5
    assert c.stage_mem(range(0, 3)) == 60
    with pytest.raises(PlanError, match=r"outside the 3 layers"):
        c.fwd_stage_ms(range(2, 4))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"fwd_ms": [1, 1], "bwd_ms": [1], "mem_bytes": [0, 0]},
            r"differ in length \(fwd_ms=2, bwd_ms=1, mem_bytes=2\)",
        ),
        ({"fwd_ms": [], "bwd_ms": [], "mem_bytes": []}, r"at least 1 layer"),
        (
            {"fwd_ms": [1, -1, 1], "bwd_ms": [1, 1, 1], "mem_bytes": [0, 0, 0]},
            r"fwd_ms\[1\] of layer 1 \('b'\) is -1",
        ),
        (
            {"fwd_ms": [1, 1, 1], "bwd_ms": [1, 1, math.nan], "mem_bytes": [0, 0, 0]},
            r"bwd_ms\[2\] of layer 2 \('c'\) is nan",
        ),
        (
            {"fwd_ms": [math.inf, 1, 1], "bwd_ms": [1, 1, 1], "mem_bytes": [0, 0, 0]},
            r"fwd_ms\[0\] of layer 0 \('a'\) is inf",
        ),
        (
            {"fwd_ms": [1, 1, 1], "bwd_ms": [1, 1, 1], "mem_bytes": [0, -5, 0]},
            r"mem_bytes\[1\] of layer 1 \('b'\) is -5",
        ),
        (
            {"fwd_ms": [1, 1, 1], "bwd_ms": [1, 1, 1], "mem_bytes": [0, 1.5, 0]},
            r"mem_bytes\[1\].*whole number",
        ),
        ({"fwd_ms": [1, "x", 1], "bwd_ms": [1, 1, 1], "mem_bytes": [0, 0, 0]}, r"fwd_ms\[1\].*'x'"),
    ],
)
def test_costs_validation_names_the_layer(kwargs: dict[str, list[float]], message: str) -> None:
    names = ["a", "b", "c"] if all(len(v) == 3 for v in kwargs.values()) else None
    with pytest.raises(PlanError, match=message):
        LayerCosts(**kwargs, names=names)  # type: ignore[arg-type]


def test_costs_validation_without_names_and_name_count() -> None:
    with pytest.raises(PlanError, match=r"fwd_ms\[1\] of layer 1 is -2\.0"):
        LayerCosts([0.0, -2.0], [0.0, 0.0], [0, 0])
    with pytest.raises(PlanError, match=r"names=1"):
        LayerCosts([1.0, 1.0], [1.0, 1.0], [0, 0], ["only"])
    assert issubclass(PlanError, ValueError)


def test_uniform_scales_the_head() -> None:
    c = LayerCosts.uniform(4, fwd_ms=1.0, bwd_ms=2.0, mem_bytes=10, head_factor=3.5)
    assert c.fwd_ms == (1.0, 1.0, 1.0, 3.5)
    assert c.bwd_ms == (2.0, 2.0, 2.0, 7.0)
    assert c.mem_bytes == (10, 10, 10, 35)
    assert LayerCosts.uniform(1).fwd_ms == (1.0,)
    with pytest.raises(PlanError, match="num_layers must be an integer >= 1, got 0"):
        LayerCosts.uniform(0)


def test_costs_json_round_trip(tmp_path: Path) -> None:
    for names in (None, ["embed", "h.0", "head"]):
        c = LayerCosts([0.1, 1.0 / 3, 3.5], [0.2, 2.0 / 3, 7.0], [5, 1000, 3500], names)
        path = tmp_path / f"costs-{names is None}.json"
        c.to_json(path)
        assert LayerCosts.from_json(path) == c
        data = json.loads(path.read_text())
        assert set(data) == ({"fwd_ms", "bwd_ms", "mem_bytes"} | ({"names"} if names else set()))
        assert LayerCosts.from_dict(json.loads(json.dumps(c.to_dict()))) == c


def test_costs_from_dict_rejects_unknown_and_missing_keys() -> None:
    with pytest.raises(PlanError, match=r"unknown key\(s\) \['fwd'\]"):
        LayerCosts.from_dict({"fwd": [1], "fwd_ms": [1], "bwd_ms": [1], "mem_bytes": [0]})
    with pytest.raises(PlanError, match=r"lack \['mem_bytes'\]"):
        LayerCosts.from_dict({"fwd_ms": [1], "bwd_ms": [1]})
