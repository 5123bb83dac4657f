"""Evaluation: forward only through the pipe, nothing of training touched, packing-independent."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

import roundpipe
from roundpipe.data.batching import eval_batches
from roundpipe.data.tokenizer import ByteLevelTokenizer
from roundpipe.errors import ConfigError
from roundpipe.train import make_config
from roundpipe.train.data import prepare_data
from roundpipe.train.evaluate import evaluate
from tests.helpers import tiny_causal_lm
from tests.test_packing import examples


def make_pipe(model: torch.nn.Module, async_optimizer: bool = False) -> roundpipe.RoundPipe:
    config = roundpipe.RunConfig(devices="cpu:2", num_microbatches=2, async_optimizer=async_optimizer)
    return roundpipe.RoundPipe(model, lambda p: torch.optim.AdamW(p, lr=1e-2), config)


def batch(seed: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 64, (4, 12), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids.clone()}


@pytest.mark.parametrize("async_optimizer", [False, True])
def test_evaluate_is_forward_only_and_changes_nothing(async_optimizer: bool) -> None:
    model = tiny_causal_lm("qwen3", attn="sdpa")
    plain, probed = make_pipe(copy.deepcopy(model), async_optimizer), make_pipe(model, async_optimizer)
    with plain, probed:
        assert probed.evaluate(batch(0)) == pytest.approx(plain.forward_backward(batch(0)), abs=1e-6)
        plain.step()
        probed_losses = [probed.forward_backward(batch(0))]
        probed.step()
        plain_losses = []
        for step in range(1, 4):
            probed.evaluate(batch(9))  # between steps; with the async optimizer, a step in flight
            assert probed.iteration_count == probed.step_count == step
            probed_losses.append(probed.forward_backward(batch(step)))
            probed.step()
            plain_losses.append(plain.forward_backward(batch(step)))
            plain.step()
        plain.synchronize()
        probed.synchronize()  # its last step too, before its weights are read
        assert probed_losses[1:] == plain_losses  # bit-exact: evaluation changed nothing of training
        for a, b in zip(plain.module.parameters(), probed.module.parameters(), strict=True):
            assert torch.equal(a, b)


def test_eval_loss_is_the_same_packed_or_padded() -> None:
    data = examples((5, 9, 3, 7, 4, 6, 2))
    with make_pipe(tiny_causal_lm("qwen3", attn="sdpa")) as pipe:
        packed = evaluate(pipe, eval_batches(data, seq_len=16, batch_size=2, pad_id=0, packing=True), 0)
        padded = evaluate(pipe, eval_batches(data, seq_len=16, batch_size=2, pad_id=0, packing=False), 0)
    assert packed["eval_tokens"] == padded["eval_tokens"] == sum(e.trainable for e in data)
    assert packed["eval_loss"] == pytest.approx(padded["eval_loss"], abs=1e-5)
    assert packed["eval_perplexity"] == pytest.approx(torch.tensor(packed["eval_loss"]).exp().item())


def test_eval_split_of_a_text_holds_out_its_end(tmp_path: Path) -> None:
    path = tmp_path / "t.txt"
    path.write_text("".join(chr(97 + i % 26) for i in range(200)))
    options = {"data": str(path), "tokenizer": "byte", "seq_len": 8, "batch_size": 4, "microbatches": 2}
    data = prepare_data(make_config({**options, "eval_split": 0.2}), ByteLevelTokenizer())
    held = torch.cat([b["input_ids"] for b in data.eval_batches])
    assert held.shape == (5, 8) and held.flatten().tolist() == list(path.read_bytes()[160:])
    assert all(b["input_ids"].shape[0] <= 2 for b in data.eval_batches)  # one microbatch a call
    assert data.batch(0)["input_ids"].shape == (4, 8)
    with pytest.raises(ConfigError, match="needs an eval set"):
        make_config({"eval_every": 5})
    with pytest.raises(ConfigError, match="not both"):
        make_config({"eval_split": 0.1, "eval_data": "x.jsonl"})


def test_report_to_tensorboard_without_the_package_exits_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from roundpipe.cli import main
    from roundpipe.train import board

    monkeypatch.setattr(board, "tensorboard_available", lambda: False)
    assert main(["train", "--report-to", "tensorboard", "--out", str(tmp_path)]) == 2
    assert "pip install 'roundpipe[tensorboard]'" in capsys.readouterr().err
    assert board.check_report_to("auto") is False and board.check_report_to("none") is False
