"""Where a GPU run's memory goes: the allocator's history around roundpipe's peak, with stacks.

Why: the planner predicts each device's peak from per-layer measurements; when a run's measured
peak differs, the allocator's own record (every allocation and free, with the Python stack that
made it) says which tensors were alive at the peak and who made them. This runs a few steps of a
Qwen3-shaped model with the history recorded and writes a gzipped snapshot plus a JSON summary:
the live bytes at the peak grouped by the innermost roundpipe frame that allocated them.

    python bench/gpu_memory_snapshot.py --layers 8 --seq 2048 --batch 32 --microbatches 4 --budget 12GiB --out DIR
"""

from __future__ import annotations

import argparse
import gzip
import json
import pickle
import sys
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parent))

from gpu_throughput_run import Shape, Workload, adamw, build_model, make_batch

import roundpipe


def _frame_of(frames: list[dict]) -> str:
    """The innermost frame inside roundpipe (else the innermost Python frame)."""
    for frame in frames:
        name = frame.get("filename", "")
        if "roundpipe/" in name:
            return f"{name.split('roundpipe/')[-1]}:{frame.get('line')} {frame.get('name')}"
    for frame in frames:
        if frame.get("filename", "").endswith(".py"):
            return f"{frame['filename'].split('/')[-1]}:{frame.get('line')} {frame.get('name')}"
    return "?"


def live_at_peak(snapshot: dict) -> dict[str, object]:
    """Replay the device trace; at the peak of live bytes, group the live blocks by frame."""
    live: dict[int, tuple[int, str]] = {}
    total = peak = 0
    at_peak: dict[int, tuple[int, str]] = {}
    for device_trace in snapshot.get("device_traces", []):
        for event in device_trace:
            action, addr, size = event["action"], event["addr"], event["size"]
            if action == "alloc":
                live[addr] = (size, _frame_of(event.get("frames", [])))
                total += size
                if total > peak:
                    peak, at_peak = total, dict(live)
            elif action in ("free_requested", "free") and addr in live:
                total -= live.pop(addr)[0]
    groups: dict[str, int] = {}
    for size, frame in at_peak.values():
        groups[frame] = groups.get(frame, 0) + size
    top = sorted(groups.items(), key=lambda kv: -kv[1])[:25]
    return {"peak_live_gib": peak / 2**30, "by_frame_gib": {k: round(v / 2**30, 3) for k, v in top}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--budget", default="12GiB")
    p.add_argument("--sync", action="store_true")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path("."))
    args = p.parse_args()
    shape = Shape(args.layers, 2048, 6144, 16, 8, 128, 151936, True)
    workload = Workload("probe", shape, args.batch, args.seq, args.microbatches, budget=args.budget)
    model = build_model(workload, torch.bfloat16)
    batch = make_batch(workload)
    config = roundpipe.RunConfig(
        devices="cuda:0",
        num_microbatches=args.microbatches,
        precision="bf16",
        async_optimizer=not args.sync,
        memory_budget=args.budget,
    )
    torch.cuda.memory._record_memory_history(max_entries=200_000, context="alloc", stacks="python")
    summary: dict[str, object] = {"args": vars(args) | {"out": str(args.out)}}
    try:
        with roundpipe.RoundPipe(model, optimizer=adamw([]), config=config) as pipe:
            for _ in range(args.steps):
                pipe.forward_backward(batch)
                pipe.step()
            pipe.synchronize()
            prediction = pipe.memory_prediction
            summary["predicted_peak_gib"] = None if prediction is None else prediction.peak_bytes / 2**30
            summary["plan"] = str(pipe.plan)
    except Exception as exc:  # the snapshot is the point, also (above all) after an out-of-memory
        summary["error"] = f"{type(exc).__name__}: {exc}"[:2000]
    summary["measured_peak_gib"] = torch.cuda.max_memory_allocated(0) / 2**30
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    summary["live_at_peak"] = live_at_peak(snapshot)
    args.out.mkdir(parents=True, exist_ok=True)
    with gzip.open(args.out / "snapshot.pickle.gz", "wb") as f:
        pickle.dump(snapshot, f)
    (args.out / "memory_summary.json").write_text(json.dumps(summary, indent=1, default=str))
    print(json.dumps(summary, indent=1, default=str))


if __name__ == "__main__":
    main()
