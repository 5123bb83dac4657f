"""One Perfetto view of several processes: the per-rank traces of a run under torchrun, merged.

Why: under torchrun each process writes the Perfetto trace of its own pipe (`roundpipe train`
writes rank 0's as trace.json and rank R's as trace.rank<R>.json in the run directory). Looking
at them side by side is how one sees a slow rank or a step that waited for a peer's gradients.
The merge keeps every event and renumbers the processes so that rank R's ``device 0`` becomes the
process ``rank R: device 0``, ranks in order. Each rank's clock starts when it builds its pipe,
right after a barrier all ranks pass together, so the timelines line up to within that barrier's
skew; nothing is shifted.

This module reads and writes JSON only: it must never import torch, and never change an event's
times or arguments.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from roundpipe.sched.views import atomic_write

RANK_FILE = re.compile(r"trace\.rank(\d+)\.json$")
MERGED_FILE = "trace.merged.json"


def rank_files(paths: list[Path]) -> list[tuple[int, Path]]:
    """(rank, file) of each input in rank order: a run directory stands for its trace.json (rank
    0) and trace.rank<R>.json files; a file named trace.rank<R>.json is rank R; any other file
    takes the next free rank in the order given."""
    found: list[tuple[int | None, Path]] = []
    for path in paths:
        if path.is_dir():
            inside = [path / "trace.json", *path.glob("trace.rank*.json")]
            found += [(_rank_of(p), p) for p in inside if p.is_file()]
            if not found:
                raise ValueError(f"{path} holds no trace.json nor trace.rank<R>.json")
        elif path.is_file():
            found.append((_rank_of(path), path))
        else:
            raise ValueError(f"{path}: no such file or directory")
    taken = {rank for rank, _ in found if rank is not None}
    ranked: list[tuple[int, Path]] = []
    free = (r for r in range(len(found) + len(taken)) if r not in taken)
    for rank, path in found:
        ranked.append((rank if rank is not None else next(free), path))
    ranks = [rank for rank, _ in ranked]
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"two traces of the same rank among {[str(p) for _, p in ranked]}")
    return sorted(ranked)


def _rank_of(path: Path) -> int | None:
    match = RANK_FILE.search(path.name)
    if match:
        return int(match.group(1))
    return 0 if path.name == "trace.json" else None


def _load(path: Path) -> dict[str, Any]:
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON ({exc})") from exc
    if not isinstance(document, dict) or not isinstance(document.get("traceEvents"), list):
        raise ValueError(f"{path} is not a Perfetto/Chrome trace (no traceEvents list)")
    return document


def merge_perfetto(inputs: list[tuple[int, Path]], out: Path) -> Path:
    """Write the events of every ``(rank, file)`` into ``out``, one process per rank and device."""
    documents = [(rank, path, _load(path)) for rank, path in inputs]
    stride = 1 + max((int(e.get("pid", 0)) for _, _, d in documents for e in d["traceEvents"]), default=0)
    events: list[dict[str, Any]] = []
    others: dict[str, Any] = {}
    for rank, path, document in documents:
        for event in document["traceEvents"]:
            event = dict(event, pid=rank * stride + int(event.get("pid", 0)))
            if event.get("ph") == "M" and event.get("name") == "process_name":
                name = event.get("args", {}).get("name", "")
                event["args"] = {"name": f"rank {rank}: {name}"}
            elif event.get("ph") == "M" and event.get("name") == "process_sort_index":
                index = int(event.get("args", {}).get("sort_index", 0))
                event["args"] = {"sort_index": rank * stride + index}
            events.append(event)
        others[f"rank {rank}"] = dict(document.get("otherData", {}), file=str(path))
    merged = {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"generator": "roundpipe trace merge", "ranks": others},
    }
    return atomic_write(out, lambda f: json.dump(merged, f, separators=(",", ":")))


__all__ = ["MERGED_FILE", "merge_perfetto", "rank_files"]
