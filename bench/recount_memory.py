"""A recorded run's predicted peak counted again from its slot breakdown, by today's memory model.

Why: a GPU run's JSON line (`bench/gpu_throughput.py`) keeps the prediction it planned with, slot
by slot (stage, prefetched stages, activations in flight, the previous stage draining), and its
measured peak. When the model's count changes, the runs already made say how far the new count
sits from their peaks without spending device time on them again.

What it recounts: the drain of a stage with small gradients (`roundpipe.plan.memory.predict_peak`)
is now counted apart from the farthest prefetched stage, whose upload waits for the draining
stage's last compute. A slot breakdown holds the prefetched stages' bytes as one sum, so a run that
prefetched one stage is recounted exactly (that stage is the farthest); a run that prefetched more
is recounted where its draining slots, even counted as recorded, stay below a slot that does not
drain (then its peak is unchanged); others are reported as not recounted. A record made by the
model as it counts now says so (``drain_apart``) and is kept as it is. The next run's first
inputs, which the model counts in flight beside a run (`roundpipe.plan.in_flight`), are not added
to a record: it holds no per-layer boundary bytes to count them from. The drain of a fully
trained stage (large gradients) is not reduced by the model, and a line does not say which a slot
had: a full fine-tune (``lora_r`` 0) is left as it was.

With ``--next-run-dense`` (runs whose 4-bit weights were dense once a stage run,
``RunConfig.dequantize``) each slot followed by a forward or fused run on its device (one device)
also gets that run's dense copies, from the record's shape (the decoder layers' attention and MLP
linears, or experts, in bf16): what a device holds when a run makes
its copies at its first compute whatever the run before still holds, as a forward run's first
microbatch may compute before the last of the run before. The runtime waits for the run before
to drop its copies instead (`roundpipe.backends.dense_runs`); the option says what a peak above
its prediction came from.

    python bench/recount_memory.py [--next-run-dense] runs.jsonl [more.jsonl ...]

Prints one JSON line per run: workload, measured peak, the prediction as recorded and as
recounted (GiB), and each against the peak.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

GIB = 1 << 30


def recount(prediction: dict[str, Any], adapters_only: bool) -> int | None:
    """The peak bytes of a recorded prediction counted as the model counts now (module docstring);
    None where the breakdown cannot say."""
    slots = prediction["slots"]
    if not adapters_only or prediction.get("drain_apart"):
        return int(prediction["peak_bytes"])
    if prediction.get("prefetch", 1) != 1:
        # Unchanged where nothing drains; a draining slot's recount is at most its recorded total.
        steady = max((s["total_bytes"] for s in slots if not s["draining_bytes"]), default=0)
        draining = max((s["total_bytes"] for s in slots if s["draining_bytes"]), default=0)
        return steady if draining <= steady else None
    return max(
        s["stage_bytes"]
        + s["in_flight_bytes"]
        + s["prefetch_bytes"]
        + max(0, s["draining_bytes"] - s["prefetch_bytes"])
        for s in slots
    )


def dense_layer_bytes(shape: dict[str, Any]) -> int:
    """The bf16 bytes of one decoder layer's 4-bit linears, dense (module docstring)."""
    hidden, head_dim = shape["hidden"], shape["head_dim"]
    attention = hidden * head_dim * (2 * shape["heads"] + 2 * shape["kv_heads"])
    mlp = 3 * hidden * shape["intermediate"] * max(1, shape["experts"])  # every expert's, if any
    return 2 * (attention + mlp)


def with_next_run_dense(prediction: dict[str, Any], recounted: int, shape: dict[str, Any]) -> int:
    """``recounted`` (the peak counted by `recount`) with each slot's next run's dense copies
    added where that run is a forward or fused one (one device; layer 0 and the last hold none)."""
    slots, per_layer = prediction["slots"], dense_layer_bytes(shape)
    extra = []
    for index in range(len(slots)):
        following = slots[(index + 1) % len(slots)]
        first, stop = following["layers"]
        decoders = sum(1 <= layer <= shape["layers"] for layer in range(first, stop))
        extra.append(0 if following["kind"] == "bwd" else decoders * per_layer)
    # A slot's drain recount lowers no total below its recorded stage, prefetch and activations.
    return max(recounted, *(s["total_bytes"] + e for s, e in zip(slots, extra, strict=True)))


def runs(paths: list[Path]) -> Iterator[dict[str, Any]]:
    for path in paths:
        for text in path.read_text().splitlines():
            if text.startswith("{"):
                line = json.loads(text)
                if isinstance(line.get("roundpipe"), dict) and "predicted_memory" in line["roundpipe"]:
                    yield line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument(
        "--next-run-dense", action="store_true", help="add the next run's dense copies (docstring)"
    )
    args = parser.parse_args()
    for line in runs(args.files):
        side = line["roundpipe"]
        peak_gib = max(side["peak_gib"].values())
        prediction = side["predicted_memory"]
        recounted = recount(prediction, adapters_only=bool(line.get("lora_r")))
        if recounted is not None and args.next_run_dense and line.get("base_format") == "nf4":
            recounted = with_next_run_dense(prediction, recounted, line["shape"])
        out: dict[str, Any] = {"workload": line["workload"], "peak_gib": peak_gib}
        out["recorded_gib"] = round(prediction["peak_bytes"] / GIB, 2)
        out["recorded_vs_peak"] = round(prediction["peak_bytes"] / GIB / peak_gib - 1, 4)
        if recounted is None:
            out["recounted_gib"] = "not recounted: stages prefetched ahead of a draining peak slot"
        else:
            out["recounted_gib"] = round(recounted / GIB, 2)
            out["recounted_vs_peak"] = round(recounted / GIB / peak_gib - 1, 4)
        print(json.dumps(out))


if __name__ == "__main__":
    main()
