"""`bench/gpu_memory_snapshot.py`: the live bytes at the allocator's peak, replayed from its history.

The GPU is not needed for the arithmetic: a history is a list of allocations and frees with the
stacks that made them, so a hand-made one has a known peak and known owners.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from bench.gpu_memory_snapshot import live_at_peak, recorded

RUNTIME = "/x/roundpipe/backends/runtime.py"
MODEL = "/x/transformers/models/llama/modeling_llama.py"


def frames(*where: tuple[str, int, str]) -> list[dict[str, Any]]:
    return [{"filename": f, "line": line, "name": name} for f, line, name in where]


def alloc(addr: int, size: int, stack: list[dict[str, Any]]) -> dict[str, Any]:
    return {"action": "alloc", "addr": addr, "size": size, "frames": stack}


def free(addr: int) -> dict[str, Any]:
    return {"action": "free_requested", "addr": addr}


GIB = 2**30
COMPUTE = frames((MODEL, 10, "forward"), (RUNTIME, 300, "compute"), (RUNTIME, 200, "run"))
UPLOAD = frames((RUNTIME, 250, "upload"), (RUNTIME, 200, "run"))
HISTORY = {
    "device_traces": [
        [
            alloc(1, 2 * GIB, UPLOAD),
            alloc(2, GIB, COMPUTE),
            free(2),
            alloc(3, 3 * GIB, COMPUTE),  # the peak: 1 and 3 (5 GiB)
            free(3),
            free(99),  # a block made before the record: not counted
            alloc(4, GIB, UPLOAD),
        ]
    ]
}


def test_the_peak_is_replayed_and_its_bytes_named_by_task_frame_and_line() -> None:
    live = live_at_peak(HISTORY, uploads={1: [(1, "param_up (0, 1)")], 4: [(4, "act_up (0, 2)")]})
    assert live["peak_live_gib"] == 5.0
    assert live["by_task_gib"] == {"runtime.compute": 3.0, "runtime.upload": 2.0}
    assert live["by_code_gib"] == {
        "llama/modeling_llama.py:10 forward": 3.0,
        "backends/runtime.py:250 upload": 2.0,
    }
    assert live["uploads_alive_mib"] == {"param_up (0, 1)": 2048.0}


def test_an_upload_alive_at_the_peak_is_named_by_its_own_block_not_a_later_one_at_its_address() -> None:
    """An address serves many blocks in turn: the upload named is the one recorded from the live
    block's allocation on and before the address's next allocation; a history whose allocations
    fall short of the count (cut by its entry limit) names none rather than the wrong ones."""
    history = {
        "device_traces": [
            [
                alloc(1, 2 * GIB, UPLOAD),  # allocation 11 (the history began after 10)
                alloc(3, 3 * GIB, COMPUTE),  # 12: the peak, 1 and 3
                free(1),
                alloc(1, 2 * GIB, UPLOAD),  # 13: a later upload at the same address
                free(3),
            ]
        ]
    }
    uploads = {1: [(11, "act_up slot 9"), (13, "act_up slot 16")], 3: [(9, "made before the history")]}
    live = live_at_peak(history, uploads, first_allocation=10, last_allocation=13)
    assert live["peak_live_gib"] == 5.0 and live["uploads_alive_mib"] == {"act_up slot 9": 2048.0}
    assert live_at_peak(history, uploads, first_allocation=10, last_allocation=20)["uploads_alive_mib"] == {}


def test_recorded_writes_the_summary_and_restores_the_runtime(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over a block: history on, then off; the runtime's methods patched, then as they were; the
    summary file holds the facts as the block left them, and it and the short form agree."""
    import roundpipe.backends.runtime as runtime_module

    calls: list[Any] = []
    monkeypatch.setattr(
        torch.cuda.memory, "_record_memory_history", lambda *a, **k: calls.append(k.get("enabled", "on"))
    )
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", lambda: HISTORY)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 6 * GIB)
    original = runtime_module.Runtime.run
    facts: dict[str, Any] = {}
    with recorded(tmp_path / "snap", facts=facts, snapshot_file=True) as short:
        assert runtime_module.Runtime.run is not original  # the task log is in place
        assert short == {}
        facts["plan"] = "filled in during the block"
    assert runtime_module.Runtime.run is original and calls == ["on", None]
    written = json.loads((tmp_path / "snap" / "memory_summary.json").read_text())
    assert written["measured_peak_gib"] == 6.0 and written["live_at_peak"]["peak_live_gib"] == 5.0
    assert (
        written["plan"] == "filled in during the block"
        and (tmp_path / "snap" / "snapshot.pickle.gz").exists()
    )
    assert short["peak_live_gib"] == 5.0 and short["by_task_gib"] == written["live_at_peak"]["by_task_gib"]
    assert short["summary"].endswith("memory_summary.json")
