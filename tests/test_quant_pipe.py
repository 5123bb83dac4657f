"""A 4-bit base through RoundPipe: the same losses and LoRA weights as a plain loop over the same
quantized model, and a quarter of the bytes uploaded for a frozen layer."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import roundpipe
from roundpipe.model.quant import NF4Linear, count_nf4, quantize_frozen_
from tests.helpers import tiny_causal_lm
from tests.test_transformers_parity import VOCAB, lora, pipe_loop, reference_loop, sgd, token_data


def lora_qwen3(seed: int = 0) -> nn.Module:
    return lora(tiny_causal_lm("qwen3", vocab=VOCAB, seed=seed), ("q_proj", "v_proj", "down_proj"))


def adapters(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}


def test_nf4_lora_matches_a_plain_loop_over_the_same_quantized_model() -> None:
    model = lora_qwen3()
    reference = quantize_frozen_(copy.deepcopy(model))  # the bytes the pipe will make
    data = token_data(3)
    expected = reference_loop(reference, data)
    losses = pipe_loop(model, data, base_format="nf4")
    assert count_nf4(model) == count_nf4(reference) == 2 * 7
    assert losses == pytest.approx(expected, rel=1e-5, abs=1e-6)
    got, want = adapters(model), adapters(reference)
    assert got.keys() == want.keys() and got
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)
    before = adapters(lora_qwen3())
    assert all(not torch.equal(got[n], before[n]) for n in got)  # it did train


def uploaded_bytes(base_format: str) -> tuple[int, dict[torch.dtype, int], int]:
    """Bytes the runtime copied into a decoder block's transient weights over one iteration, by
    dtype, and the block's frozen linear elements."""
    model = lora_qwen3()
    config = roundpipe.RunConfig(
        devices="cpu:2", num_microbatches=2, async_optimizer=False, precision="bf16", base_format=base_format
    )
    moved: dict[torch.dtype, int] = {}
    with roundpipe.RoundPipe(model, optimizer=sgd, config=config) as pipe:
        block = pipe.host.layer_params[1]  # layer 0 is the embedding
        sources = {id(pipe.host.compute[id(p)]) for _, p in block}
        pool: Any = pipe.runtime.pool
        copy_of = pool.copy_of

        def recording(source: torch.Tensor, device: torch.device, requires_grad: bool) -> torch.Tensor:
            if id(source) in sources:
                moved[source.dtype] = moved.get(source.dtype, 0) + source.numel() * source.element_size()
            return copy_of(source, device, requires_grad)

        pool.copy_of = recording
        pipe.forward_backward(token_data(1)[0], None, None)
        pipe.step()
        pipe.synchronize()
        frozen = sum(
            m.weight.numel() if isinstance(m, nn.Linear) else m.in_features * m.out_features
            for m in pipe.host.layers[1].modules()
            if isinstance(m, nn.Linear | NF4Linear) and not any(p.requires_grad for p in m.parameters())
        )
    return sum(moved.values()), moved, frozen


def test_a_frozen_block_uploads_a_quarter_of_its_bf16_bytes() -> None:
    dense, dense_dtypes, frozen = uploaded_bytes("compute")
    quantized, quantized_dtypes, _ = uploaded_bytes("nf4")
    assert quantized < dense
    assert set(dense_dtypes) == {torch.bfloat16}
    # The frozen linears travel as packed codes and raw scales: 0.5 + 4/64 bytes an element.
    uploads = dense // (frozen * 2 + 1)  # uploads of the block in the iteration (forward, backward)
    assert uploads >= 2
    assert quantized_dtypes[torch.uint8] == uploads * frozen * (0.5 + 4 / 64)
    # What else travels (norms, LoRA adapters) is the same in both.
    assert quantized_dtypes[torch.bfloat16] == dense - uploads * frozen * 2
    assert quantized_dtypes[torch.uint8] / (uploads * frozen * 2) == pytest.approx(0.28125)


def test_a_lora_run_copies_down_only_its_adapters_gradients() -> None:
    """A backward slot's gradient download moves the trainable parameters' gradients: in a LoRA
    run the adapters, not the frozen base the slot uploaded (the trace's bytes per transfer are
    what the benchmarks report as bytes moved each way)."""
    model = lora_qwen3()
    config = roundpipe.RunConfig(devices="cpu:2", num_microbatches=2, async_optimizer=False, precision="bf16")
    with roundpipe.RoundPipe(model, optimizer=sgd, config=config) as pipe:
        pipe.forward_backward(token_data(1)[0], None, None)
        pipe.step()
        pipe.synchronize()
        tasks = list(pipe.trace())
        adapters = sum(p.numel() * 2 for p in model.parameters() if p.requires_grad)
        uploaded = sum(t.nbytes for t in tasks if t.kind == "param_up")
    downloaded = sum(t.nbytes for t in tasks if t.kind == "grad_down")
    assert downloaded == adapters  # each layer's adapter gradients once, in bf16
    assert uploaded > 10 * downloaded


def test_train_cli_nf4_lora_export_loads_onto_the_original_base(tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from roundpipe.cli import main
    from tests.helpers import tiny_model_dir, train_args

    model_dir = tiny_model_dir(tmp_path / "model")
    args = train_args(model_dir, tmp_path, "q", 2, "--lora-r", "4", "--base-format", "nf4", "--sync")
    assert main([*args, "--export", str(tmp_path / "adapter")]) == 0
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16)
    dense = {n: p.detach().clone() for n, p in base.named_parameters()}
    loaded = PeftModel.from_pretrained(base, str(tmp_path / "adapter"))
    assert count_nf4(loaded) == 0
    lora_b = [p for n, p in loaded.named_parameters() if "lora_B" in n]
    assert lora_b and all(bool(p.abs().sum() > 0) for p in lora_b)  # trained away from zero
    attention = loaded.base_model.model.model.layers[0].self_attn.q_proj.base_layer
    assert torch.equal(attention.weight, dense["model.layers.0.self_attn.q_proj.weight"])
    ids = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(loaded(input_ids=ids).logits).all()


def test_nf4_needs_a_frozen_base() -> None:
    config = roundpipe.RunConfig(devices="cpu:1", base_format="nf4")
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    with pytest.raises(roundpipe.ConfigError, match="freeze the base"):
        roundpipe.RoundPipe(model, optimizer=sgd, config=config)


@pytest.mark.gpu
def test_nf4_lora_on_cuda_matches_a_plain_peft_loop() -> None:
    """The same quantized weights through RoundPipe on cuda:0 and through a plain loop on the GPU
    give the same losses, within bf16's tolerance."""
    model = lora_qwen3()
    quantize_frozen_(model)
    reference = copy.deepcopy(model).to("cuda", torch.bfloat16)
    data = token_data(3)
    opt = sgd([p for p in reference.parameters() if p.requires_grad])
    expected = []
    for batch in data:
        loss = reference(**{k: v.cuda() for k, v in batch.items()}).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        expected.append(loss.item())
    losses = pipe_loop(model, data, devices="cuda:0", num_microbatches=1, precision="bf16", base_format="nf4")
    assert losses == pytest.approx(expected, rel=2e-2, abs=2e-2)
