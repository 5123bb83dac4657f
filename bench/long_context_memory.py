"""The long-context workload's memory, predicted on a CPU: per-layer bytes measured small, scaled.

Why: G (the Llama-3.1-8B shape, one 262,144-token sequence) gets minutes of GPU time at most, so
whether it fits, and whether the planner's prediction will be right, is settled here first. A
decoder layer of the same proportions (hidden 128, GQA 4 like the 8B, intermediate 3.5x hidden,
LoRA on q/k/v/o) runs roundpipe's sliced forward and backward (`roundpipe.model.chunked_layer`)
on the CPU at two lengths; the bytes each phase allocates (a dispatch-mode ledger standing in for
the CUDA allocator) give, per hidden-sized tensor, what the profile (`backends/profile.py`) will
measure on the GPU: saved bytes, forward working set, backward working set. Those are scaled to
the 8B at the requested lengths, the one term the CPU kernel does not have is added (flash
attention's fp32 dq accumulator, [tokens, heads, head_dim] in fp32, on CUDA), and the planner
(`device_plan.plan_from`, the code the run uses) plans and predicts with them.

    python bench/long_context_memory.py --tokens 131072,196608,262144 --budget 24GiB

It prints one JSON line per (tokens, base format). It must never touch a GPU.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import weakref
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.append(str(Path(__file__).resolve().parent))

GIB = 1 << 30
HIDDEN, HEADS, KV_HEADS, INTERMEDIATE = 4096, 32, 8, 14336
VOCAB, LAYERS, LORA_R = 128256, 32, 16
SMALL = dict(hidden=128, heads=8, kv_heads=2, intermediate=448)
SMALL_CHUNK = 64


class Ledger(TorchDispatchMode):
    """Bytes of the storages created under it and still alive, and the peak since `mark`."""

    def __init__(self, existing: Any) -> None:
        super().__init__()
        self.known = {t.untyped_storage().data_ptr() for t in existing}
        self.live: dict[int, int] = {}
        self.now = self.peak = 0

    def mark(self) -> int:
        self.peak = self.now
        return self.now

    def _free(self, key: int) -> None:
        self.now -= self.live.pop(key)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key and key not in self.live and key not in self.known:
                    self.live[key] = storage.nbytes()
                    self.now += storage.nbytes()
                    self.peak = max(self.peak, self.now)
                    weakref.finalize(storage, self._free, key)
        return out


def small_layer() -> tuple[torch.nn.Module, torch.nn.Module]:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from roundpipe.model.chunked_layer import chunk_long_attention_layer
    from roundpipe.model.chunked_mlp import chunk_long_sequences

    s = SMALL
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=s["hidden"],
        intermediate_size=s["intermediate"],
        num_hidden_layers=1,
        num_attention_heads=s["heads"],
        num_key_value_heads=s["kv_heads"],
        head_dim=s["hidden"] // s["heads"],
        use_cache=False,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    lora = LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]
    )
    base = get_peft_model(model, lora).get_base_model()
    assert isinstance(base, LlamaForCausalLM)  # from_config of a LlamaConfig, LoRA wrapped around it
    layer = copy.deepcopy(base.model.layers[0])
    assert isinstance(layer, LlamaDecoderLayer)
    chunk_long_attention_layer(layer)
    chunk_long_sequences(layer.mlp)
    return layer, base.model.rotary_emb


def phases(layer: torch.nn.Module, rotary: torch.nn.Module, tokens: int) -> dict[str, int]:
    """The profile's three figures for one row of ``tokens``: saved (what the forward with grad
    leaves, less the output), forward working set (peak above that), backward working set (peak
    above what was alive before it, less the parameters' fresh gradients)."""
    hidden = SMALL["hidden"]
    x = torch.randn(1, tokens, hidden, requires_grad=True)
    grad = torch.randn(1, tokens, hidden)
    with torch.no_grad():
        cos, sin = rotary(x, torch.arange(tokens)[None])
    out_bytes = x.numel() * 4
    with Ledger([x, grad, cos, sin, *layer.parameters()]) as ledger:
        with torch.no_grad():
            ledger.mark()
            layer(x, position_embeddings=(cos, sin))
        nograd_work = ledger.peak - out_bytes
        start = ledger.mark()
        y = layer(x, position_embeddings=(cos, sin))
        saved = ledger.now - start - out_bytes
        grad_work = ledger.peak - ledger.now
        before = ledger.mark()
        y.backward(grad)
        fresh = sum(p.grad.numel() * 4 for p in layer.parameters() if p.grad is not None)
        bwd_work = ledger.peak - before - fresh
    return {"saved": saved, "work": max(nograd_work, grad_work), "bwd_work": bwd_work}


def per_unit(t1: int = 2048, t2: int = 4096) -> dict[str, tuple[float, float]]:
    """Per figure: (hidden-sized tensors per token, bytes that do not grow), fp32 units."""
    from roundpipe.model import chunked_layer, chunked_mlp

    for module in (chunked_layer, chunked_mlp):
        module.CHUNK_TOKENS, module.MIN_TOKENS = SMALL_CHUNK, 2 * SMALL_CHUNK  # type: ignore[attr-defined]
    layer, rotary = small_layer()
    a, b = phases(layer, rotary, t1), phases(layer, rotary, t2)
    unit = SMALL["hidden"] * 4
    out = {}
    for k in a:
        slope = (b[k] - a[k]) / ((t2 - t1) * unit)
        out[k] = (slope, b[k] - slope * t2 * unit)
    return out


def layer_memory(tokens: int, fit: dict[str, tuple[float, float]], base_format: str) -> Any:
    """The 8B's `LayerMemory` at ``tokens``: embed, 32 blocks, head."""
    from roundpipe.model.chunked_layer import CHUNK_TOKENS
    from roundpipe.plan.memory import LayerMemory

    unit = tokens * HIDDEN * 2  # one hidden-sized bf16 tensor
    # A slice's workspace grows with the slice and the MLP's width, in bf16 against fp32 small.
    ws = CHUNK_TOKENS * INTERMEDIATE * 2 / (SMALL_CHUNK * SMALL["intermediate"] * 4)
    # CUDA flash backward, per call (one KV group): the fp32 query-gradient accumulator.
    flash_dq_accum = tokens * (HIDDEN // KV_HEADS) * 4
    kv = HIDDEN // HEADS * KV_HEADS
    dense = HIDDEN * (2 * HIDDEN + 2 * kv) + 3 * HIDDEN * INTERMEDIATE
    block_params = int(dense * (2 if base_format == "bf16" else 0.5625)) + 2 * HIDDEN * 2
    lora = LORA_R * (2 * (HIDDEN + HIDDEN) + 2 * (HIDDEN + kv)) * 2
    carried = tokens * (HEADS and 128) * 2 * 2 + tokens * 8  # cos, sin in bf16; labels
    block = {k: int(s * unit + max(0.0, c) * ws) for k, (s, c) in fit.items()}
    embed_params = head_params = VOCAB * HIDDEN * 2
    n = LAYERS + 2
    return LayerMemory(
        param_bytes=(embed_params, *[block_params + lora] * LAYERS, head_params),
        grad_bytes=(0, *[lora] * LAYERS, 0),
        saved_bytes=(0, *[block["saved"]] * LAYERS, unit),  # head: the loss's input gradient
        work_bytes=(unit, *[block["work"]] * LAYERS, unit + 2 * 384 * VOCAB * 2),
        boundary_bytes=(tokens * 16, *[unit + carried] * (n - 1)),
        bwd_work_bytes=(0, *[block["bwd_work"] + flash_dq_accum] * LAYERS, unit),
        carried_bytes=(0, *[carried] * (n - 1)),
    )


def plan(
    tokens: int, fit: dict[str, tuple[float, float]], base_format: str, budget: int | None
) -> dict[str, Any]:
    from roundpipe import RunConfig
    from roundpipe.errors import PlanError
    from roundpipe.plan.costs import LayerCosts
    from roundpipe.plan.memory import layer_plan_bytes
    from roundpipe.planning.device_plan import plan_from

    memory = layer_memory(tokens, fit, base_format)
    attention_ms = 1000.0 * (tokens / 262144) ** 2  # an H200's flash forward of one 8B layer, about
    costs = LayerCosts(
        fwd_ms=(1.0, *[attention_ms + 60.0] * LAYERS, 40.0),
        bwd_ms=(1.0, *[2.5 * attention_ms + 120.0] * LAYERS, 80.0),
        mem_bytes=layer_plan_bytes(memory, "layer"),
    )
    config = RunConfig(devices="cpu:1", num_microbatches=1, recompute_grain="layer", precision="bf16")
    line: dict[str, Any] = {
        "tokens": tokens,
        "base_format": base_format,
        "budget_gib": budget and budget / GIB,
    }
    unit = tokens * HIDDEN * 2
    line["block_gib"] = {
        "input": round(unit / GIB, 2),
        "saved": round(memory.saved_bytes[1] / GIB, 2),
        "work": round(memory.work_bytes[1] / GIB, 2),
        "bwd_work": round(memory.bwd_work_bytes[1] / GIB, 2),
    }
    try:
        device_plan = plan_from(config, costs, memory, 1, budget, "cuda")
    except PlanError as exc:
        line["plan_error"] = str(exc)[:400]
        return line
    prediction = device_plan.prediction
    line["plan"] = str(device_plan.plan).splitlines()[0]
    line["predicted_peak_gib"] = round(prediction.peak_bytes / GIB, 2)
    line["peak_slot"] = prediction.describe()
    return line


def main(argv: list[str] | None = None) -> None:
    from gpu_throughput_run import parse_size

    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--tokens", default="131072,196608,262144")
    p.add_argument("--budget", default="24GiB", help='"none": no cap')
    p.add_argument("--base-format", default="bf16,nf4")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    fit = per_unit()
    print(json.dumps({"per_token_hidden_tensors": {k: round(v[0], 3) for k, v in fit.items()}}), flush=True)
    budget = None if args.budget.lower() == "none" else parse_size(args.budget)
    for tokens in (int(t) for t in args.tokens.split(",")):
        for fmt in args.base_format.split(","):
            print(json.dumps(plan(tokens, fit, fmt, budget)), flush=True)


if __name__ == "__main__":
    main()
