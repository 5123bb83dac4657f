"""A model loaded shard by shard trains: LoRA on a frozen base that stays mapped from the files,
with the losses and adapters of the same run on ``from_pretrained``'s model; and `roundpipe
train --model DIR` goes through the loader."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

import roundpipe
from roundpipe.model.loading import load_pretrained
from tests.test_loading import mapped, mappings, reference, save_tiny
from tests.test_transformers_parity import lora, sgd, token_data


def run(model: nn.Module, steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    config = roundpipe.RunConfig(devices="cpu:2", num_microbatches=2, async_optimizer=False, precision="fp32")
    losses = []
    with roundpipe.RoundPipe(model, optimizer=sgd, config=config) as pipe:
        for batch in token_data(steps):
            losses.append(pipe.forward_backward(batch, None, None))
            pipe.step()
        pipe.synchronize()
    adapters = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return losses, adapters


def test_lora_on_a_mapped_base_trains_like_from_pretrained(tmp_path: Path) -> None:
    path = save_tiny(tmp_path / "m", "qwen3", dtype=torch.float32)
    base, report = load_pretrained(path, dtype=torch.float32, frozen=True)
    assert report.mapped_bytes == report.file_bytes and report.copied_bytes == 0
    model = lora(base)
    ranges = mappings(path)
    frozen = {n: p for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen and all(mapped(p, ranges) for p in frozen.values())
    ref_base = reference(path, torch.float32)
    for p in ref_base.parameters():
        p.requires_grad_(False)
    expected_losses, expected_adapters = run(lora(ref_base), 2)
    losses, adapters = run(model, 2)
    assert losses == pytest.approx(expected_losses, rel=1e-6, abs=1e-7)
    for name, tensor in expected_adapters.items():
        torch.testing.assert_close(adapters[name], tensor, rtol=1e-5, atol=1e-6)
    # The pipe's host copy of the frozen base is the mapped file itself: nothing was copied.
    assert all(mapped(p, ranges) for p in frozen.values())


def test_train_cli_loads_a_sharded_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from roundpipe.cli import main
    from roundpipe.data.tokenizer import SHIPPED_TOKENIZER, load_tokenizer
    from tests.helpers import tiny_causal_lm

    tokenizer = load_tokenizer(SHIPPED_TOKENIZER)
    path = tmp_path / "model"
    tiny_causal_lm("qwen3", vocab=len(tokenizer), attn="sdpa").to(torch.bfloat16).save_pretrained(
        str(path), max_shard_size="20KB"
    )
    tokenizer.save_pretrained(str(path))
    assert len(list(path.glob("model-*.safetensors"))) > 2
    args = ["train", "--model", str(path), "--steps", "1", "--seq-len", "16", "--batch-size", "4"]
    args += ["--microbatches", "2", "--devices", "cpu:1", "--lora-r", "4", "--precision", "bf16"]
    args += ["--out", str(tmp_path), "--name", "run", "--json"]
    assert main(args) == 0
    out = capsys.readouterr()
    summary = json.loads(out.out.strip().splitlines()[-1])
    assert summary["steps"] == 1 and summary["final_loss"] > 0
    assert "GB mapped from the files" in out.err and "Loading weights" not in out.err


def test_nf4_lora_run_quantizes_while_loading(tmp_path: Path) -> None:
    """`--lora-r --base-format nf4` on a model directory: the adapters go onto the skeleton, each
    base linear is quantized as it arrives and equals quantizing from_pretrained's model; the
    adapters are drawn from the seed alike in every build, and the pipe trains it."""
    from roundpipe.data.tokenizer import SHIPPED_TOKENIZER, load_tokenizer
    from roundpipe.model.quant import NF4Linear, count_nf4, quantize_frozen_
    from roundpipe.train import make_config
    from roundpipe.train.model import add_lora, build_model
    from tests.helpers import tiny_causal_lm

    tokenizer = load_tokenizer(SHIPPED_TOKENIZER)
    path = tmp_path / "model"
    tiny_causal_lm("llama", vocab=len(tokenizer), attn="sdpa").to(torch.bfloat16).save_pretrained(
        str(path), max_shard_size="20KB"
    )
    config = make_config({"model": str(path), "lora_r": 4, "base_format": "nf4", "precision": "bf16"})
    model = build_model(config, tokenizer)
    assert count_nf4(model) == 14
    again = build_model(config, tokenizer)
    adapters = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert adapters and all(p.dtype == torch.float32 and p.device.type == "cpu" for p in adapters.values())
    assert all(torch.equal(p, dict(again.named_parameters())[n]) for n, p in adapters.items())
    assert any(p.abs().sum() > 0 for n, p in adapters.items() if "lora_A" in n)
    ref = add_lora(reference(path, torch.bfloat16), config)
    quantize_frozen_(ref)
    mine = dict(model.named_modules())
    assert mine.keys() == dict(ref.named_modules()).keys()
    for name, theirs in ref.named_modules():
        if isinstance(theirs, NF4Linear):
            assert isinstance(mine[name], NF4Linear) and torch.equal(mine[name].packed, theirs.packed), name
            assert torch.equal(mine[name].absmax, theirs.absmax), name
    run_config = roundpipe.RunConfig(
        devices="cpu:2", num_microbatches=2, async_optimizer=False, precision="bf16", base_format="nf4"
    )
    with roundpipe.RoundPipe(model, optimizer=sgd, config=run_config) as pipe:
        batch = {k: v % len(tokenizer) for k, v in token_data(1)[0].items()}
        loss = pipe.forward_backward(batch, None, None)
        pipe.step()
        pipe.synchronize()
    assert torch.isfinite(torch.tensor(loss))
