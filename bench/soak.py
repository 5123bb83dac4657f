"""Soak: many short `roundpipe train` runs on ``cpu:2`` killed at random points and resumed, each
checked bit for bit against an uninterrupted run.

What it proves: whatever stops a run (SIGKILL with a checkpoint half written, SIGTERM from a
scheduler, Ctrl-C, at a step boundary or at an arbitrary moment), resuming from what is on disk
ends with exactly the weights an uninterrupted run ends with, and the run's metrics.jsonl holds
every step once. Each soak run draws from a seeded generator one to three faults: a signal
(SIGKILL, SIGTERM or SIGINT) either at a named point (``step:N``, ``save:N``: `roundpipe.faults`,
the process signals itself there) or after a random delay sent by this script (the only part
that is not reproducible to the instruction). After each stop it resumes from
``<run>/checkpoint`` (or starts again when no checkpoint was written yet), until the run
completes; then it compares the final checkpoint's weights (and in-flight weights) and the
logged losses with the uninterrupted run's.

Each attempt is a forked child of this process, which imported torch and transformers once and
started no thread, so an attempt costs the training, not the imports. Children use one torch
thread and no matplotlib (the timeline picture is skipped), which keeps a run near a second.

    python bench/soak.py --minutes 10            # as many runs as fit, summary on the last line
    python bench/soak.py --runs 20 --seed 3      # a fixed number of runs

Prints one JSON line per run (faults, exit codes, match) and a summary line
``{"runs", "faults", "stops", "attempts", "mismatches", "errors", ...}`` (``stops``: attempts a
fault ended early; a fault at a point the attempt never reaches, such as a step before the
resumed one, does not fire); exits 1 on any mismatch or error.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

STEPS, SAVE_EVERY = 8, 2
SIGNALS = ("SIGKILL", "SIGTERM", "SIGINT")
# What an attempt may end with when a fault fired: saved and stopped (130, 143), killed (-9),
# or a SIGTERM/SIGINT that arrived before the run installed its handlers (-15, 130).
STOPPED = {0, 130, 143, -9, -15}


def train_args(model: Path, out: Path, name: str) -> list[str]:
    return [
        "train", "--model", str(model), "--steps", str(STEPS), "--save-every", str(SAVE_EVERY),
        "--seq-len", "16", "--batch-size", "4", "--microbatches", "2", "--warmup-steps", "2",
        "--lr", "3e-3", "--devices", "cpu:2", "--out", str(out), "--name", name, "--json",
    ]  # fmt: skip


def attempt(argv: list[str], faults: str, log: Path, kill_after: tuple[float, int] | None) -> int:
    """Run ``roundpipe`` with ``argv`` in a forked child; return its exit code (-N: signal N)."""
    pid = os.fork()
    if pid == 0:  # the child: never returns
        code = 1
        try:
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            from roundpipe import faults as fault_points
            from roundpipe.cli import main

            fault_points.arm(faults)
            code = main(argv)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    if kill_after is not None:
        delay, sig = kill_after
        deadline = time.monotonic() + delay
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return os.waitstatus_to_exitcode(status)
            time.sleep(0.005)
        os.kill(pid, sig)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def draw_faults(rng: random.Random, run_seconds: float) -> list[dict[str, Any]]:
    faults: list[dict[str, object]] = []
    for _ in range(rng.randint(1, 3)):
        sig = rng.choice(SIGNALS)
        if rng.random() < 0.6:
            point = rng.choice(["step", "save"])
            number = (
                rng.randint(1, STEPS) if point == "step" else rng.randrange(SAVE_EVERY, STEPS + 1, SAVE_EVERY)
            )
            faults.append({"signal": sig, "at": f"{point}:{number}"})
        else:
            faults.append({"signal": sig, "after_s": round(rng.uniform(0.0, run_seconds), 3)})
    return faults


def final_state(run: Path) -> dict[str, bytes]:
    checkpoint = run / "checkpoint"
    return {
        name: (checkpoint / name).read_bytes()
        for name in ("weights.safetensors", "in_flight_weights.safetensors")
        if (checkpoint / name).is_file()
    }


def losses(run: Path) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [(int(r["step"]), float(r["loss"])) for r in rows]


def soak_run(model: Path, out: Path, index: int, rng: random.Random, run_seconds: float) -> dict[str, Any]:
    name = f"run{index}"
    run, log = out / name, out / f"{name}.log"
    faults = draw_faults(rng, run_seconds)
    codes: list[int] = []
    for fault in [*faults, None]:
        while True:
            if (run / "checkpoint" / "meta.json").is_file():
                argv = ["train", "--resume", str(run / "checkpoint"), "--json"]
            else:
                shutil.rmtree(run, ignore_errors=True)  # stopped before its first checkpoint
                argv = train_args(model, out, name)
            spec, timer = "", None
            if fault is not None and "at" in fault:
                spec = f"{fault['signal']}@{fault['at']}"
            elif fault is not None:
                timer = (fault["after_s"], int(signal.Signals[fault["signal"]]))
            code = attempt(argv, spec, log, timer)
            codes.append(code)
            if code == 2 and "nothing to do" in log.read_text():
                code = 0  # the fault hit after the last save: the run was already complete
            if code not in STOPPED:
                return {"run": index, "faults": faults, "codes": codes, "error": f"exit {code}, see {log}"}
            if fault is not None or code == 0:
                break
    return {"run": index, "faults": faults, "codes": codes}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--runs", type=int, default=None, help="number of soak runs (default: until --minutes)"
    )
    parser.add_argument("--minutes", type=float, default=10.0, help="stop starting runs after this long")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", action="store_true", help="keep the run directories")
    args = parser.parse_args()

    os.environ["OMP_NUM_THREADS"] = "1"
    import torch  # noqa: F401  (imported once here, shared by every forked attempt)
    import transformers  # noqa: F401
    from transformers import Qwen3Config

    import roundpipe.cli
    import roundpipe.train.trainer  # noqa: F401

    sys.modules["matplotlib"] = None  # type: ignore[assignment]  # no timeline.png: it costs more than a run
    out = Path(tempfile.mkdtemp(prefix="roundpipe-soak-"))
    model = out / "config.json"
    common: dict[str, Any] = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4
    )
    Qwen3Config(vocab_size=256, num_key_value_heads=2, head_dim=8, **common).to_json_file(str(model))

    t0 = time.monotonic()
    assert attempt(train_args(model, out, "reference"), "", out / "reference.log", None) == 0
    run_seconds = time.monotonic() - t0
    reference, reference_losses = final_state(out / "reference"), losses(out / "reference")

    rng = random.Random(args.seed)
    totals = {"runs": 0, "faults": 0, "stops": 0, "attempts": 0, "mismatches": 0, "errors": 0}
    start = time.monotonic()
    while (args.runs is None and time.monotonic() - start < args.minutes * 60) or (
        args.runs is not None and totals["runs"] < args.runs
    ):
        result = soak_run(model, out, totals["runs"], rng, run_seconds)
        totals["runs"] += 1
        totals["faults"] += len(result["faults"])
        totals["attempts"] += len(result["codes"])
        totals["stops"] += sum(code not in (0, 2) for code in result["codes"])
        if "error" in result:
            totals["errors"] += 1
        else:
            run = out / f"run{result['run']}"
            result["match"] = final_state(run) == reference and losses(run) == reference_losses
            totals["mismatches"] += not result["match"]
            if not args.keep and result["match"]:
                shutil.rmtree(run, ignore_errors=True)
                (out / f"run{result['run']}.log").unlink(missing_ok=True)
        print(json.dumps(result), flush=True)
    summary = {**totals, "seed": args.seed, "steps": STEPS, "save_every": SAVE_EVERY, "devices": "cpu:2"}
    summary["seconds"] = round(time.monotonic() - start, 1)
    summary["reference_run_s"] = round(run_seconds, 2)
    summary["kept"] = str(out) if args.keep or totals["mismatches"] or totals["errors"] else None
    print(json.dumps(summary), flush=True)
    if summary["kept"] is None:
        shutil.rmtree(out, ignore_errors=True)
    return 1 if totals["mismatches"] or totals["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
