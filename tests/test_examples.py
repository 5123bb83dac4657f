"""The examples run, with tiny settings, and do what they claim.

Each example is imported from ``examples/`` and its ``main(argv)`` called in this process (the
imports of torch and transformers are paid once for the whole file).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def load_example(name: str) -> ModuleType:
    path = EXAMPLES / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"roundpipe_example_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    return module


def test_lora_finetune(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("peft")
    example = load_example("lora_finetune")
    out = tmp_path / "adapters"
    argv = ["--steps", "6", "--seq-len", "32", "--batch-size", "4", "--out", str(out), "--quiet"]
    result = example.main(argv)
    assert result["loss_fell"], result["losses"]
    assert result["last_loss"] < result["first_loss"]
    assert result["base_unchanged"]
    assert result["adapters_moved"]
    assert result["same_logits"] and result["max_logit_diff"] < 1e-5
    assert result["adapter_effect"] > 1e-3  # the reloaded adapters are not a no-op
    assert (out / "adapter_config.json").is_file()
    assert "lora" in json.loads((out / "adapter_config.json").read_text())["peft_type"].lower()
    assert "reloaded" in capsys.readouterr().out


def test_asyncio_service_answers_while_training(capsys: pytest.CaptureFixture[str]) -> None:
    example = load_example("asyncio_service")
    result = example.main(
        ["--steps", "4", "--seq-len", "32", "--batch-size", "4", "--poll-ms", "5", "--quiet"]
    )
    assert result["final"]["step"] == 4 and result["final"]["state"] == "done"
    assert result["final"]["loss"] > 0 and result["final"]["tokens_per_s"] > 0
    # Status requests were answered while the pipeline trained, and saw the steps advance.
    assert result["answered_while_training"] >= 5
    assert len(result["steps_seen_while_training"]) >= 2
    # The loop kept running: generous bounds, the machine running the tests may be busy.
    assert result["loop_wakeups_while_training"] >= 5
    assert result["max_loop_delay_ms"] < 1000
    assert result["max_round_trip_ms"] < 1000
    assert "status requests while training" in capsys.readouterr().out


def test_inspect_schedule(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    example = load_example("inspect_schedule")
    argv = [
        "--out",
        str(tmp_path),
        "--layers",
        "12",
        "--devices",
        "3",
        "--microbatches",
        "6",
        "--iterations",
        "3",
    ]
    result = example.main([*argv, "--real-steps", "2"])
    sim = result["simulated"]
    assert sim["replay_identical"]
    assert sim["replay_makespan_ms"] == pytest.approx(sim["makespan_ms"])
    assert 0.0 <= sim["bubble_ratio"] < 1.0
    assert set(sim["utilisation"]) == {0, 1, 2}
    real = result["real"]
    assert real["replayed_tasks"] == real["tasks"] > 0
    assert real["lanes_same_order"] >= 1
    for name in ("simulated.trace.json", "simulated.perfetto.json", "cpu.trace.json", "cpu.perfetto.json"):
        assert (tmp_path / name).stat().st_size > 0, name
    events = json.loads((tmp_path / "simulated.perfetto.json").read_text())
    assert events  # Chrome/Perfetto trace events
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "simulated.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert (tmp_path / "cpu.png").is_file()
    text = capsys.readouterr().out
    assert "check_rules(): the five ordering rules hold" in text
    assert "(identical)" in text


def test_chat_finetune(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A model directory with its tokenizer, conversations, LoRA with packing and an eval split,
    the export, and generation from the exported adapters."""
    pytest.importorskip("peft")
    result = load_example("chat_finetune").main(["--steps", "8", "--work", str(tmp_path)])
    assert result["last_loss"] < result["first_loss"]
    assert result["eval_loss"] is not None
    assert {"adapter_model.safetensors", "adapter_config.json", "tokenizer.json"} <= set(result["exported"])
    assert isinstance(result["reply"], str)
    assert json.loads(capsys.readouterr().out)["reply"] == result["reply"]
