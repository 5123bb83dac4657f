"""The GPU benchmark's models: transformers configs per family, and the layer-by-layer builder.

Why apart: a 70B base does not fit the host in bf16 (128 GiB), and drawing 32B random weights on
16 host cores takes far longer than the device call allows. So a big workload is built as a
skeleton on the meta device, then one group of modules at a time (the embedding, each decoder
layer, the final norm, the LM head) is materialised on the build device, drawn from a seeded
generator, quantized there when the base is 4-bit, and moved to the host: the host only ever
holds the final layout, plus one layer in flight. On CPU the same code runs with the CPU as the
build device, so the smoke tests exercise every step but the device.

It must never hold two full copies of a model, nor decide what runs or print a result.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

FAMILIES = ("qwen3", "llama", "qwen3_moe", "gpt_oss")
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
INIT_STD = 0.02


def hf_config(shape: Any, seq: int) -> Any:
    """The transformers config of ``shape`` (a `gpu_throughput_run.Shape`), sdpa-ready, no cache."""
    import transformers

    common: dict[str, Any] = dict(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=max(seq, 4096),
        tie_word_embeddings=shape.tied,
        use_cache=False,
    )
    family = shape.family
    if family == "qwen3":
        return transformers.Qwen3Config(intermediate_size=shape.intermediate, **common)
    if family == "llama":
        return transformers.LlamaConfig(intermediate_size=shape.intermediate, **common)
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            intermediate_size=shape.intermediate,
            moe_intermediate_size=shape.intermediate,
            num_experts=shape.experts,
            num_experts_per_tok=shape.experts_per_token,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            output_router_logits=False,
            **common,
        )
    if family == "gpt_oss":
        kinds = ("sliding_attention", "full_attention")
        return transformers.GptOssConfig(
            intermediate_size=shape.intermediate,
            num_local_experts=shape.experts,
            num_experts_per_tok=shape.experts_per_token,
            sliding_window=shape.sliding_window or 128,
            layer_types=[kinds[i % 2] for i in range(shape.layers)],
            output_router_logits=False,
            **common,
        )
    raise ValueError(f"unknown model family {family!r}; choose from {FAMILIES}")


def attention(shape: Any) -> str:
    """sdpa (flash, no mask for causal full attention), except GPT-OSS, whose attention sinks
    transformers runs in its eager path only: its 4096-token microbatches make dense masks and
    [heads, 4096, 4096] scores per layer, which the profile measures and the plan counts."""
    return "eager" if shape.family == "gpt_oss" else "sdpa"


@functools.cache
def meta_param_count(shape: Any) -> int:
    """Parameters of the model of ``shape``, counted on a skeleton that allocates nothing."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config(shape, 4096), dtype=torch.bfloat16)
    return sum(p.numel() for p in model.parameters())


def lora_config(r: int) -> Any:
    from peft import LoraConfig

    return LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0, target_modules=LORA_TARGETS)


def build_layerwise(
    shape: Any, seq: int, lora_r: int, base_format: str, dtype: torch.dtype, device: torch.device
) -> nn.Module:
    """The model of ``shape`` on the host, each group of modules drawn on ``device`` (seeded: the
    same weights on every run of one device type), LoRA on q/k/v/o when ``lora_r`` > 0, and each
    decoder layer's frozen linears in ``base_format`` ("nf4": `roundpipe.model.quant`)."""
    from transformers import AutoModelForCausalLM

    config = hf_config(shape, seq)
    with torch.device("meta"):
        model: Any = AutoModelForCausalLM.from_config(
            config, attn_implementation=attention(shape), dtype=dtype
        )
        model.to(dtype)  # a config that names its own dtype wins over the keyword in some releases
    if lora_r > 0:
        from peft import get_peft_model

        model = get_peft_model(model, lora_config(lora_r))
    base = model.get_base_model() if lora_r > 0 else model
    quantize = _quantizer(base_format)
    for index, (group, is_layer) in enumerate(_groups(base)):
        group.to_empty(device=device)
        _draw(group, torch.Generator(device=device).manual_seed(1000 + index))
        if is_layer and quantize is not None:
            quantize(group)
        _to_host(group, pinned=device.type == "cuda")
        if device.type == "cuda":
            torch.cuda.empty_cache()
    # Rotary tables are buffers computed from the config: made again on the host.
    base.model.rotary_emb = type(base.model.rotary_emb)(config=config)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"the layer-by-layer build left tensors on the meta device: {left[:5]}")
    return model


@torch.no_grad()
def _to_host(module: nn.Module, pinned: bool) -> None:
    """Move ``module``'s tensors to the host, each straight into its own pinned buffer when a GPU
    will read it: the run then uses them as its compute copy instead of copying the whole base
    into pinned arenas beside them (twice the base on the host while it copies)."""
    if not pinned:
        module.to("cpu")
        return
    for sub in module.modules():
        for param in sub._parameters.values():
            if param is not None and param.device.type != "cpu":
                param.data = _pinned_copy(param)
        for name, buffer in sub._buffers.items():
            if buffer is None or buffer.device.type == "cpu":
                continue
            if isinstance(buffer, nn.Parameter):
                buffer.data = _pinned_copy(buffer)
            else:
                sub._buffers[name] = _pinned_copy(buffer)


def _pinned_copy(t: torch.Tensor) -> torch.Tensor:
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t)
    return host


def _groups(base: Any) -> Iterator[tuple[nn.Module, bool]]:
    """The modules materialised one at a time, and whether each is a decoder layer."""
    yield base.model.embed_tokens, False
    for layer in base.model.layers:
        yield layer, True
    yield base.model.norm, False
    if base.lm_head.weight is not base.model.embed_tokens.weight:
        yield base.lm_head, False


@torch.no_grad()
def _draw(module: nn.Module, generator: torch.Generator) -> None:
    """Random weights a trained model could have: N(0, 0.02) matrices and embeddings, unit norm
    scales, zero biases, attention sinks and LoRA B (so the adapters start as the identity)."""
    for name, p in module.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if "lora_B" in name or leaf in ("bias", "sinks") or leaf.endswith("_bias"):
            p.zero_()
        elif p.dim() == 1:
            p.fill_(1.0)
        else:
            p.normal_(0.0, INIT_STD, generator=generator)
    for _, b in module.named_buffers():
        b.zero_()


def _quantizer(base_format: str) -> Any:
    if base_format in ("bf16", "compute"):
        return None
    if base_format != "nf4":
        raise ValueError(f"unknown base format {base_format!r}; choose bf16 or nf4")
    try:
        from roundpipe.model.quant import quantize_frozen_
    except ImportError as exc:
        raise RuntimeError(
            "base format nf4 needs roundpipe.model.quant.quantize_frozen_ (branch nf4), which this "
            "checkout lacks"
        ) from exc

    def quantize(module: nn.Module) -> None:
        quantize_frozen_(module, fmt="nf4")

    return quantize
