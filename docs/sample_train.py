"""Rewrite the sample output of ``roundpipe train`` in docs/train.md from a real run.

Why: a sample typed into the docs goes stale as soon as the defaults or the output change (a
time, a loss or a bubble ratio that no run gives any more). This script runs the command as a
user would (no arguments: the main job, 80 columns, in a scratch directory), and replaces the
block between the ``<!-- sample: roundpipe train -->`` and ``<!-- /sample -->`` markers with what
it printed; tests/test_train_docs_sample.py fails when the block's lines no longer have the shape
of what the command prints. It must never edit anything but that block.

    python docs/sample_train.py                 # the main job, about 1.5-2 minutes on 2 cores
    python docs/sample_train.py --steps 20      # extra arguments go to roundpipe train (a quick look)

Prints one JSON line: the figures of the run it wrote into the block.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DOC = Path(__file__).resolve().parent / "train.md"
BEGIN, END = "<!-- sample: roundpipe train -->", "<!-- /sample -->"
JSON_BEGIN = "<!-- sample: roundpipe train --json -->"
WIDTH = 80
_BOX = re.compile(r"[━│┃┌┐└┘├┤┬┴┼─╭╮╰╯┏┓┗┛┡┩╇┳┻]+")
_NUMBER = re.compile(r"\d[\d,.:]*%?")


def shape(line: str) -> str:
    """A line with its figures, bars and table rules taken out: what stays the same from run to
    run (``step N/N loss N N tok/s ETA N``)."""
    return " ".join(_NUMBER.sub("N", _BOX.sub(" ", line)).split())


def table_label(line: str) -> str | None:
    """The first cell of a summary-table row (``tokens/s``), None for any other line."""
    if not line.lstrip().startswith("│"):
        return None
    cells = line.strip().strip("│").split("│")
    label = cells[0].strip() if cells else ""
    return label or None


def sample_block(text: str, begin: str = BEGIN) -> list[str]:
    """The lines between ``begin`` and the next end marker (without the code fence and the
    ``$`` line)."""
    start = text.index(begin) + len(begin)
    lines = text[start : text.index(END, start)].strip("\n").splitlines()
    return [line for line in lines if not line.startswith(("```", "$ "))]


def _replace(text: str, begin: str, body: list[str]) -> str:
    start = text.index(begin)
    end = text.index(END, start) + len(END)
    return text[:start] + "\n".join([begin, *body, END]) + text[end:]


def run(extra: list[str]) -> tuple[list[str], dict[str, object], float]:
    with tempfile.TemporaryDirectory() as work:
        env = {**os.environ, "COLUMNS": str(WIDTH), "TERM": "dumb"}
        repo = str(Path(__file__).resolve().parents[1])
        env["PYTHONPATH"] = repo + os.pathsep + env.get("PYTHONPATH", "")
        started = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-m", "roundpipe.cli", "train", *extra, "--json"],
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
        wall = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"roundpipe train failed ({done.returncode}):\n{done.stderr}")
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    return [line.rstrip() for line in done.stderr.splitlines() if line.strip()], summary, wall


def main(argv: list[str]) -> int:
    lines, summary, wall = run(argv)
    command = " ".join(["roundpipe train", *argv])
    text = _replace(DOC.read_text(encoding="utf-8"), BEGIN, ["```", f"$ {command}", *lines, "```"])
    text = _replace(text, JSON_BEGIN, ["```json", json.dumps(summary, indent=1), "```"])
    DOC.write_text(text, encoding="utf-8")
    keys = ("initial_loss", "final_loss", "bubble_ratio", "tokens_per_s", "steady_tokens_per_s", "elapsed_s")
    print(
        json.dumps(
            {"doc": str(DOC), "command": command, "wall_s": round(wall, 1)} | {k: summary[k] for k in keys}
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
