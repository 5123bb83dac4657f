"""`bench/run_overlap.py` on a short F: the engine overlaps forward runs when uploads go in as
soon as they may; both ways of keeping runs in order never do, and ordering the uploads (the
default) is the faster of the two and no slower than the free graph on the fake stream backend."""

from __future__ import annotations

from bench.run_overlap import measure


def test_runs_overlap_only_in_the_free_graph() -> None:
    free, computes, uploads = (
        measure(2, order, link_gbps=45.0, decoders=8) for order in ("free", "computes", "uploads")
    )
    assert free["slots"] == computes["slots"] == uploads["slots"] == 9
    assert free["runs_overlapped"] > 0
    assert computes["runs_overlapped"] == uploads["runs_overlapped"] == 0
    assert computes["ms_per_iteration"] >= free["ms_per_iteration"] >= uploads["ms_per_iteration"]
    assert uploads["ms_per_iteration"] < computes["ms_per_iteration"]
