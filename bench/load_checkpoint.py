"""Loading a sharded checkpoint into the host layout: peak host memory against what the run holds,
and the load rate from the page cache.

Why: a frozen base must never be whole in host memory in any other form than the one it is kept in
(bf16 views of the files, or 4-bit), so the peak resident size of a load is a budget like a GPU's.
The bench writes a Llama-shaped bf16 model as shards (once, into ``--dir``), reads the files once
so the page cache holds them, then runs each case in a fresh subprocess (so peaks do not mix):

- ``bf16``: roundpipe's loader, every weight frozen in bf16 (views of the files), then every byte
  touched once as a first training step would;
- ``nf4``: the same with ``base_format="nf4"``: frozen linears quantized as their shard arrives;
- ``from_pretrained``: transformers' own load in bf16, for comparison.

One JSON line per case: ``held_bytes`` (the bytes of the model's parameters and buffers), the
process's peak resident size over its baseline (``VmHWM`` minus the resident size before loading),
their ratio (target <= 1.15), seconds to load and to touch, and GB/s of file bytes.

    python bench/load_checkpoint.py [--dir /tmp/roundpipe-load-bench] [--layers 10] [--hidden 2048]
        [--shard-size 200MB] [--cases bf16,nf4,from_pretrained]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch


def status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def make_model(args: argparse.Namespace) -> None:
    """A Llama-shaped bf16 model saved in shards, filled with small random values (fast: no init)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 11 // 4,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 128,
        num_key_value_heads=args.hidden // 128,
        tie_word_embeddings=False,
    )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.to_empty(device="cpu")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator).mul_(0.02))
    model.save_pretrained(args.dir, max_shard_size=args.shard_size)


def held_bytes(model: torch.nn.Module) -> int:
    seen: set[int] = set()
    total = 0
    for tensor in [*model.parameters(), *model.buffers()]:
        if id(tensor) not in seen:
            seen.add(id(tensor))
            total += tensor.numel() * tensor.element_size()
    return total


def touch(model: torch.nn.Module) -> None:
    """Read one byte of every page of every parameter (what a first forward does to the mapping)."""
    for param in model.parameters():
        flat = param.detach().reshape(-1).view(torch.uint8)
        flat[::4096].sum()


def warm_up(directory: str) -> None:
    """Import and build once what every case needs (model classes, a skeleton, the NF4 tables),
    so the baseline holds the code and the case's peak holds only the model."""
    from roundpipe.model.loading import load_skeleton_config, model_skeleton
    from roundpipe.model.quant import quantize_nf4

    model_skeleton(load_skeleton_config(Path(directory)))
    quantize_nf4(torch.randn(64, 64, dtype=torch.bfloat16))


def run_case(args: argparse.Namespace) -> dict[str, Any]:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    from roundpipe.model.loading import load_pretrained

    torch.set_num_threads(args.threads)
    warm_up(args.dir)
    baseline_kb = status_kb("VmRSS")
    t0 = time.perf_counter()
    report = None
    model: torch.nn.Module
    if args.case == "from_pretrained":
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(args.dir, dtype=torch.bfloat16)
    else:
        base_format = "nf4" if args.case == "nf4" else "compute"
        model, report = load_pretrained(
            args.dir, dtype=torch.bfloat16, frozen=True, frozen_dtype=torch.bfloat16, base_format=base_format
        )
    load_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    touch(model)
    touch_s = time.perf_counter() - t1
    file_bytes = sum(p.stat().st_size for p in Path(args.dir).glob("*.safetensors"))
    held = held_bytes(model)
    peak = (status_kb("VmHWM") - baseline_kb) * 1024
    out: dict[str, Any] = {
        "case": args.case,
        "file_gb": round(file_bytes / 1e9, 3),
        "held_gb": round(held / 1e9, 3),
        "peak_over_baseline_gb": round(peak / 1e9, 3),
        "peak_to_held": round(peak / held, 3),
        "baseline_rss_gb": round(baseline_kb * 1024 / 1e9, 3),
        "rss_file_gb": round(status_kb("RssFile") * 1024 / 1e9, 3),
        "rss_anon_gb": round(status_kb("RssAnon") * 1024 / 1e9, 3),
        "load_s": round(load_s, 3),
        "touch_s": round(touch_s, 3),
        "gbps": round(file_bytes / (load_s + touch_s) / 1e9, 3),
        "threads": args.threads,
    }
    if report is not None:
        out |= {
            "mapped_gb": round(report.mapped_bytes / 1e9, 3),
            "copied_gb": round(report.copied_bytes / 1e9, 3),
            "quantized_gb": round(report.quantized_bytes / 1e9, 3),
            "nf4_gb": round(report.nf4_bytes / 1e9, 3),
            "files": report.files,
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dir", default="/tmp/roundpipe-load-bench")
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--shard-size", default="200MB")
    parser.add_argument("--cases", default="bf16,nf4,from_pretrained")
    parser.add_argument("--threads", type=int, default=min(4, os.cpu_count() or 1))
    parser.add_argument("--case", help=argparse.SUPPRESS)  # one case, in this process
    parser.add_argument("--make", action="store_true", help=argparse.SUPPRESS)  # write the model
    args = parser.parse_args()
    if args.make:
        make_model(args)
        return
    if args.case:
        print(json.dumps(run_case(args)), flush=True)
        return
    if not (Path(args.dir) / "model.safetensors.index.json").is_file():
        subprocess.run([sys.executable, __file__, "--dir", args.dir, "--make", *_shape(args)], check=True)
    for file in Path(args.dir).glob("*.safetensors"):  # into the page cache
        with open(file, "rb") as f:
            while f.read(1 << 24):
                pass
    for case in args.cases.split(","):
        cmd = [sys.executable, __file__, "--dir", args.dir, "--case", case, "--threads", str(args.threads)]
        subprocess.run(cmd, check=True)


def _shape(args: argparse.Namespace) -> list[str]:
    return ["--layers", str(args.layers), "--hidden", str(args.hidden), "--shard-size", args.shard_size]


if __name__ == "__main__":
    main()
