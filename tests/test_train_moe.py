"""`roundpipe train` on a mixture-of-experts config: router auxiliary loss on, LoRA on the experts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from roundpipe.cli import main
from tests.helpers import metrics_logged, train_args
from tests.test_train_cli import interrupt_at
from tests.test_transformers_parity import tiny_qwen3_moe


def test_lora_experts_trains_and_exports_expert_adapters(tmp_path: Path) -> None:
    tiny_qwen3_moe(router_logits=True).config.save_pretrained(str(tmp_path / "moe"))
    args = train_args(tmp_path / "moe" / "config.json", tmp_path, "moe", 1, "--sync", "--lora-r", "2")
    assert main([*args, "--lora-experts", "--export", str(tmp_path / "hf")]) == 0
    adapter = json.loads((tmp_path / "hf" / "adapter_config.json").read_text())
    assert sorted(adapter["target_parameters"]) == ["experts.down_proj", "experts.gate_up_proj"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--lora-experts"], "--lora-experts adds expert adapters to a LoRA run: give --lora-r R too"),
        (["--lora-r", "2", "--lora-experts"], "has no expert weights; it applies to mixture-of-experts"),
    ],
)
def test_lora_experts_misuse_exits_2(
    extra: list[str], message: str, model_config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*train_args(model_config, tmp_path, "bad", 1), *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("roundpipe: error: ") and message in err, err
    assert "Traceback" not in err


def test_lora_qkvo_on_moe_resumes_exactly_and_exports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """LoRA on q/k/v/o with frozen experts (run as grouped products), the router auxiliary loss
    on: a run cut by Ctrl-C after two of four steps and resumed gives the losses of the run that
    was not cut; the export is an adapter of the attention projections only."""
    tiny_qwen3_moe(router_logits=True).config.save_pretrained(str(tmp_path / "moe"))
    config = tmp_path / "moe" / "config.json"
    assert main([*train_args(config, tmp_path, "full", 4, "--sync", "--lora-r", "2")]) == 0
    interrupt_at(monkeypatch, 2, "signal")
    assert main([*train_args(config, tmp_path, "cut", 4, "--sync", "--lora-r", "2")]) == 130
    monkeypatch.undo()
    checkpoint = tmp_path / "cut" / "checkpoint"
    assert main(["train", "--resume", str(checkpoint), "--export", str(tmp_path / "hf")]) == 0
    full, cut = metrics_logged(tmp_path / "full"), metrics_logged(tmp_path / "cut")
    assert [r["step"] for r in cut] == [1, 2, 3, 4]
    assert [r["loss"] for r in cut] == [r["loss"] for r in full]  # bit-exact
    adapter = json.loads((tmp_path / "hf" / "adapter_config.json").read_text())
    assert sorted(adapter["target_modules"]) == ["k_proj", "o_proj", "q_proj", "v_proj"]
    assert not adapter.get("target_parameters")
