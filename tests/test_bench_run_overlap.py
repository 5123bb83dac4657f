"""`bench/run_overlap.py` on a short F: the engine overlaps forward runs, the in-order graphs never
do, and keeping runs in order is never faster on the fake stream backend."""

from __future__ import annotations

from bench.run_overlap import measure


def test_runs_overlap_unless_kept_in_order() -> None:
    free = measure(2, in_order=False, link_gbps=45.0, decoders=8)
    ordered = measure(2, in_order=True, link_gbps=45.0, decoders=8)
    assert free["slots"] == ordered["slots"] == 9
    assert free["runs_overlapped"] > 0 and ordered["runs_overlapped"] == 0
    assert ordered["ms_per_iteration"] >= free["ms_per_iteration"]
