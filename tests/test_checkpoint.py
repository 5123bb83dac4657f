"""Checkpoints: round trip, atomic replacement, exact resume, clear errors, Hugging Face export."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
import torch
from torch import nn

import roundpipe
from roundpipe.checkpoint import CheckpointError, export_pretrained, load_checkpoint, save_checkpoint
from roundpipe.checkpoint import store as ckpt
from roundpipe.data import CORPUS_PATH, batch_at
from tests.helpers import tiny_causal_lm
from tests.test_transformers_parity import lora, tiny_llama, tiny_qwen3

SEQ, BATCH = 16, 4
_TOKENS = torch.tensor(list(CORPUS_PATH.read_bytes()[:20000]), dtype=torch.long)


def byte_qwen3(seed: int = 0) -> nn.Module:
    return tiny_causal_lm("qwen3", vocab=256, attn="sdpa", seed=seed)


def batch(step: int) -> dict[str, torch.Tensor]:
    return batch_at(_TOKENS, step, SEQ, BATCH, seed=0)


def adamw(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=3e-3)


def warmup(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))


def make_pipe(model: nn.Module, async_optimizer: bool) -> roundpipe.RoundPipe:
    config = roundpipe.RunConfig(devices="cpu:2", num_microbatches=2, async_optimizer=async_optimizer)
    return roundpipe.RoundPipe(model, optimizer=adamw, config=config, lr_scheduler=warmup)


def train(pipe: roundpipe.RoundPipe, steps: range) -> list[float]:
    losses = []
    for step in steps:
        losses.append(pipe.forward_backward(batch(step), None, None))
        pipe.step()
    return losses


def test_round_trip(tmp_path: Path) -> None:
    model = byte_qwen3()
    with make_pipe(model, async_optimizer=True) as pipe:
        train(pipe, range(2))
        path = save_checkpoint(pipe, tmp_path / "ck", data_step=2, extra={"note": "hello", "n": [1, 2]})
        state = pipe.state_dict()
    assert path == tmp_path / "ck"
    names = sorted(p.name for p in path.iterdir())
    assert names == sorted(
        [
            "meta.json",
            "manifest.json",
            "weights.safetensors",
            "in_flight_weights.safetensors",
            "training_state.pt",
            "rng_state.pt",
        ]
    )
    meta = json.loads((path / "meta.json").read_text())
    assert (meta["step"], meta["iteration"], meta["data_step"]) == (2, 2, 2)
    assert meta["config"]["async_optimizer"] is True and meta["extra"] == {"note": "hello", "n": [1, 2]}
    assert [p.name for p in tmp_path.iterdir()] == ["ck"]  # no temporary directory left behind

    other = byte_qwen3(seed=7)
    with make_pipe(other, async_optimizer=True) as pipe:
        info = load_checkpoint(pipe, path)
        assert (info.step, info.data_step, info.extra["note"]) == (2, 2, "hello")
        assert pipe.step_count == 2
        loaded = pipe.state_dict()
    for name, tensor in state["model"].items():
        assert torch.equal(loaded["model"][name], tensor), name
    for name, tensor in state["in_flight_weights"].items():
        assert torch.equal(loaded["in_flight_weights"][name], tensor), name
    opt_a, opt_b = state["host"]["optimizers"][0], loaded["host"]["optimizers"][0]
    for key in opt_a["state"]:
        for field in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt_a["state"][key][field], opt_b["state"][key][field])
    assert loaded["host"]["schedulers"] == state["host"]["schedulers"]


def test_rng_state_is_restored(tmp_path: Path) -> None:
    with make_pipe(byte_qwen3(), async_optimizer=False) as pipe:
        torch.manual_seed(123)
        random.seed(123)
        save_checkpoint(pipe, tmp_path / "ck", data_step=0)
        expected = (torch.rand(3), random.random())
        torch.manual_seed(0)
        random.seed(0)
        load_checkpoint(pipe, tmp_path / "ck")
        assert torch.equal(torch.rand(3), expected[0]) and random.random() == expected[1]


@pytest.mark.parametrize("async_optimizer", [False, True], ids=["sync", "async"])
def test_resume_is_exact(tmp_path: Path, async_optimizer: bool) -> None:
    steps = 5
    full_model = byte_qwen3()
    with make_pipe(full_model, async_optimizer) as pipe:
        full = train(pipe, range(steps))
        pipe.synchronize()

    first = byte_qwen3()
    with make_pipe(first, async_optimizer) as pipe:
        losses = train(pipe, range(3))
        save_checkpoint(pipe, tmp_path / "ck", data_step=3)
    second = byte_qwen3(seed=5)  # different weights: everything must come from the checkpoint
    with make_pipe(second, async_optimizer) as pipe:
        info = load_checkpoint(pipe, tmp_path / "ck")
        losses += train(pipe, range(info.data_step, steps))
        pipe.synchronize()
    assert losses == full  # bit-exact
    for (name, a), b in zip(second.state_dict().items(), full_model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_replacing_is_atomic_when_a_save_crashes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "ck"
    with make_pipe(byte_qwen3(), async_optimizer=False) as pipe:
        train(pipe, range(1))
        save_checkpoint(pipe, target, data_step=1)
        saved = (target / "weights.safetensors").read_bytes()
        train(pipe, range(1, 2))

        def crash(path: Path, obj: object) -> None:
            (path).write_bytes(b"half a file")
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(ckpt, "_write_torch", crash)
        with pytest.raises(OSError, match="No space left"):
            save_checkpoint(pipe, target, data_step=2)
        monkeypatch.undo()
        # The previous checkpoint is intact under the final name, and nothing else is left.
        assert [p.name for p in tmp_path.iterdir()] == ["ck"]
        assert (target / "weights.safetensors").read_bytes() == saved
        assert load_checkpoint(pipe, target).data_step == 1

        # A hard kill skips the cleanup and leaves the temporary directory: loading ignores it,
        # the next save removes it.
        stale = tmp_path / ".tmp-ck-killed"
        stale.mkdir()
        (stale / "weights.safetensors").write_bytes(b"partial")
        assert load_checkpoint(pipe, target).data_step == 1
        save_checkpoint(pipe, target, data_step=1)
        assert [p.name for p in tmp_path.iterdir()] == ["ck"]


def test_without_atomic_exchange_a_crash_never_leaves_a_partial_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where directories cannot be swapped atomically, the old checkpoint is moved aside first.
    A crash between the two renames leaves no checkpoint under the final name, the previous one
    beside it, and an error message that says where it is."""
    target = tmp_path / "ck"
    with make_pipe(byte_qwen3(), async_optimizer=False) as pipe:
        save_checkpoint(pipe, target, data_step=0)
        monkeypatch.setattr(ckpt, "_exchange", lambda a, b: False)
        save_checkpoint(pipe, target, data_step=1)  # the fallback path works
        assert load_checkpoint(pipe, target).data_step == 1

        real_rename = os.rename
        calls = []

        def rename(src: object, dst: object) -> None:
            calls.append((src, dst))
            if len(calls) == 2:  # the crash: after moving the old one aside, before the new one lands
                raise KeyboardInterrupt
            real_rename(src, dst)  # type: ignore[arg-type]

        monkeypatch.setattr(os, "rename", rename)
        with pytest.raises(KeyboardInterrupt):
            save_checkpoint(pipe, target, data_step=2)
        monkeypatch.undo()
        assert not target.exists()
        with pytest.raises(CheckpointError, match=r"previous checkpoint is at .*\.old-ck-"):
            load_checkpoint(pipe, target)
        old = next(tmp_path.glob(".old-ck-*"))
        old.rename(target)
        assert load_checkpoint(pipe, target).data_step == 1


def test_refuses_to_replace_something_else(tmp_path: Path) -> None:
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("keep me")
    (tmp_path / "file").write_text("x")
    with make_pipe(byte_qwen3(), async_optimizer=False) as pipe:
        with pytest.raises(CheckpointError, match="not a roundpipe checkpoint"):
            save_checkpoint(pipe, tmp_path / "notes", data_step=0)
        with pytest.raises(CheckpointError, match="not a directory"):
            save_checkpoint(pipe, tmp_path / "file", data_step=0)
        with pytest.raises(CheckpointError, match="JSON"):
            save_checkpoint(pipe, tmp_path / "x", data_step=0, extra={"f": object()})
    assert (tmp_path / "notes" / "todo.txt").read_text() == "keep me"


def test_load_errors_are_clear(tmp_path: Path) -> None:
    with make_pipe(byte_qwen3(), async_optimizer=False) as pipe:
        save_checkpoint(pipe, tmp_path / "ck", data_step=0)
    with make_pipe(tiny_llama(), async_optimizer=False) as pipe:
        with pytest.raises(CheckpointError, match=r"does not match this model.*LlamaForCausalLM"):
            load_checkpoint(pipe, tmp_path / "ck")
    with make_pipe(byte_qwen3(), async_optimizer=True) as pipe:
        with pytest.raises(roundpipe.ConfigError, match="same mode"):
            load_checkpoint(pipe, tmp_path / "ck")
        with pytest.raises(CheckpointError, match="does not exist"):
            load_checkpoint(pipe, tmp_path / "nowhere")
        with pytest.raises(CheckpointError, match=r"meta\.json is missing"):
            load_checkpoint(pipe, tmp_path)
        (tmp_path / "ck" / "weights.safetensors").unlink()
        with pytest.raises(CheckpointError, match=r"incomplete: missing weights\.safetensors"):
            load_checkpoint(pipe, tmp_path / "ck")


def test_export_loads_with_from_pretrained(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = byte_qwen3()
    ids = batch(99)["input_ids"]
    with make_pipe(model, async_optimizer=True) as pipe:
        train(pipe, range(2))
        out = export_pretrained(pipe, tmp_path / "hf")
        assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
        with torch.no_grad():
            expected = pipe.module(input_ids=ids).logits
    loaded = AutoModelForCausalLM.from_pretrained(str(out))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, expected, rtol=0, atol=0)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight  # still tied


def test_peft_adapters_export_and_load(tmp_path: Path) -> None:
    from peft import PeftModel

    model = lora(tiny_qwen3())
    ids = torch.randint(0, 64, (2, SEQ), generator=torch.Generator().manual_seed(0))
    data = {"input_ids": ids, "labels": ids}
    with make_pipe(model, async_optimizer=False) as pipe:
        for _ in range(2):
            pipe.forward_backward(data, None, None)
            pipe.step()
        out = export_pretrained(pipe, tmp_path / "adapters")
        with torch.no_grad():
            expected = pipe.module(input_ids=ids).logits
    files = {p.name for p in out.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= files
    assert "model.safetensors" not in files  # adapters only, not the base weights
    loaded = PeftModel.from_pretrained(tiny_qwen3(), str(out))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, expected, rtol=0, atol=0)


def test_export_needs_save_pretrained(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    config = roundpipe.RunConfig(devices="cpu:1", num_microbatches=1)
    with roundpipe.RoundPipe(model, config=config) as pipe:
        with pytest.raises(CheckpointError, match="no save_pretrained"):
            export_pretrained(pipe, tmp_path / "x")
