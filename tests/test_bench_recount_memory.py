"""`bench/recount_memory.py`: a recorded prediction counted again as the memory model counts now.

The reference is the model itself: a plan's prediction with the drain counted whole beside the
farthest upload (as records before the change hold it) recounts to what `predict_peak` gives now.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from bench.recount_memory import main, recount
from roundpipe.plan.memory import predict_peak
from tests.test_memory_model import MEM, simple_plan

FROZEN = replace(MEM, param_bytes=(1000,) * 4, grad_bytes=(10,) * 4)  # adapters on a frozen base


def as_recorded_before(prediction: dict[str, Any], drains: list[int]) -> dict[str, Any]:
    """``prediction`` as the model counted it before: each slot's drain whole, no ``drain_apart``."""
    slots = [s | {"draining_bytes": d} for s, d in zip(prediction["slots"], drains, strict=True)]
    for s in slots:
        s["total_bytes"] = s["stage_bytes"] + s["prefetch_bytes"] + s["in_flight_bytes"] + s["draining_bytes"]
    old = {k: v for k, v in prediction.items() if k != "drain_apart"} | {"slots": slots}
    return old | {"peak_bytes": max(s["total_bytes"] for s in slots)}


def test_a_record_of_one_prefetched_stage_recounts_to_todays_prediction() -> None:
    plan = simple_plan((range(0, 2),), range(2, 4), (range(0, 2),))
    now = predict_peak(plan, FROZEN, "stage", prefetch=1).to_dict()
    before = as_recorded_before(now, [0, 0, 2020 - 312])  # B1's drain over its start, whole
    assert before["peak_bytes"] > now["peak_bytes"]
    assert recount(before, adapters_only=True) == now["peak_bytes"]
    assert recount(now, adapters_only=True) == now["peak_bytes"]  # already counted so: kept
    assert recount(before, adapters_only=False) == before["peak_bytes"]  # a full fine-tune's drain stays


def test_deeper_prefetch_recounts_only_where_the_peak_does_not_drain() -> None:
    plan = simple_plan((range(0, 2),), range(2, 4), (range(0, 2),))
    now = predict_peak(plan, FROZEN, "stage", prefetch=2).to_dict()
    # Slot totals 6456 (F1), 7044 (FB, the peak), 6572 (B1): B1 recorded with a drain of 300 still
    # stays below FB, which does not drain, so the peak is FB's whatever B1's farthest upload was.
    assert recount(as_recorded_before(now, [0, 0, 300]), adapters_only=True) == 7044
    # With a drain of 500 B1 may or may not pass FB (7072 recorded): not recounted.
    assert recount(as_recorded_before(now, [0, 0, 500]), adapters_only=True) is None


def test_the_command_prints_a_line_per_recorded_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    plan = simple_plan((range(0, 2),), range(2, 4), (range(0, 2),))
    now = predict_peak(plan, FROZEN, "stage", prefetch=1).to_dict()
    record = {"workload": "D", "lora_r": 16, "roundpipe": {"peak_gib": {"cuda:0": 1.0}}}
    record["roundpipe"]["predicted_memory"] = as_recorded_before(now, [0, 0, 2020 - 312])
    path = tmp_path / "runs.jsonl"
    path.write_text(
        "not json\n" + json.dumps(record) + "\n" + json.dumps({"workload": "x", "roundpipe": "error"})
    )
    monkeypatch.setattr("sys.argv", ["recount_memory.py", str(path)])
    main()
    lines = [json.loads(t) for t in capsys.readouterr().out.splitlines()]
    assert len(lines) == 1 and lines[0]["workload"] == "D"
    assert lines[0]["recounted_gib"] == round(now["peak_bytes"] / 2**30, 2)


def test_the_next_runs_dense_copies_go_on_slots_followed_by_a_forward_or_fused_run() -> None:
    from bench.recount_memory import dense_layer_bytes, with_next_run_dense

    shape = {
        "layers": 2,
        "hidden": 4,
        "head_dim": 2,
        "heads": 2,
        "kv_heads": 1,
        "intermediate": 8,
        "experts": 0,
    }
    per_layer = dense_layer_bytes(shape)
    assert per_layer == 2 * (4 * 2 * (2 * 2 + 2 * 1) + 3 * 4 * 8)
    moe = shape | {"experts": 16}
    assert dense_layer_bytes(moe) == 2 * (4 * 2 * (2 * 2 + 2 * 1) + 3 * 4 * 8 * 16)  # and 16 experts
    dense = replace(FROZEN, dense_bytes=(0, per_layer, per_layer, 0))  # embedding, 2 decoders, head
    plan = simple_plan((range(0, 2), range(2, 3)), range(3, 4), (range(2, 3), range(0, 2)))
    prediction = predict_peak(plan, dense, "stage", prefetch=1).to_dict()
    totals = [s["total_bytes"] for s in prediction["slots"]]
    # F1 (layers 0-1) is followed by F2 (decoder 2), F2 by FB (the head: no copies), FB and B2 by
    # backward runs, B1 by the next iteration's F1 (decoder 1).
    expected = max(totals[0] + per_layer, totals[1], totals[2], totals[3], totals[4] + per_layer)
    recounted = recount(prediction, adapters_only=True)
    assert recounted == prediction["peak_bytes"]
    assert with_next_run_dense(prediction, recounted, shape) == expected > recounted
