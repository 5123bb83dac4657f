"""Fine-tune a local model directory on conversations with LoRA, evaluate, export, generate.

What a user with a model directory and a chat dataset does, end to end, on two CPU workers:

1. a model directory: here a small Qwen3 built from a config and saved with a real tokenizer (the
   BPE tokenizer shipped with roundpipe, which has a chat template); yours comes with its own;
2. a conversation dataset, one ``{"messages": [...]}`` record a line;
3. ``roundpipe train`` with LoRA, packing and a held-out split, the loss on assistant turns only;
4. the exported adapters loaded back with transformers and peft, and a reply generated (the base
   here is random and small, so the reply shows the path a real model takes, not what it learnt).

    python examples/chat_finetune.py --steps 60
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
from pathlib import Path
from typing import Any

import torch

TOKENIZER = Path(__file__).resolve().parent.parent / "roundpipe" / "data" / "tokenizer"


def make_model_dir(directory: Path) -> None:
    """A small Qwen3 saved as a model directory, with its tokenizer and chat template."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def make_chats(path: Path, count: int = 64, seed: int = 0) -> None:
    """Arithmetic chats: a user asks for a sum, the assistant answers it."""
    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(count):
            a, b = rng.randint(1, 9), rng.randint(1, 9)
            messages = [
                {"role": "user", "content": f"What is {a} plus {b}?"},
                {"role": "assistant", "content": f"{a} plus {b} is {a + b}."},
            ]
            f.write(json.dumps({"messages": messages}) + "\n")


def generate(base_dir: Path, adapters: Path, question: str) -> str:
    """Load the base with the exported adapters and answer ``question`` greedily."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(adapters)  # the export carries the tokenizer
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), adapters)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, return_tensors="pt"
    )
    # A tensor, or (newer transformers) a BatchEncoding holding one.
    ids: torch.Tensor = prompt if isinstance(prompt, torch.Tensor) else prompt["input_ids"]  # type: ignore[index,call-overload,assignment]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    return str(tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument(
        "--work", type=Path, help="where to put the model, data and run (default: a temporary directory)"
    )
    args = p.parse_args(argv)
    from roundpipe.train import make_config, train

    with tempfile.TemporaryDirectory() as scratch:
        work = args.work or Path(scratch)
        work.mkdir(parents=True, exist_ok=True)
        make_model_dir(work / "model")
        make_chats(work / "chats.jsonl")
        config = make_config(
            {
                "model": str(work / "model"),
                "data": str(work / "chats.jsonl"),
                "lora_r": 8,
                "packing": True,
                "eval_split": 0.25,
                "eval_every": max(1, args.steps // 2),
                "steps": args.steps,
                "batch_size": 4,
                "seq_len": 64,
                "microbatches": 2,
                "lr": 1e-2,
                "report_to": "none",
                "export": str(work / "adapters"),
                "out": str(work / "runs"),
                "name": "chat",
            }
        )
        result = train(config)
        reply = generate(work / "model", work / "adapters", "What is 2 plus 3?")
        summary = result.summary()
        report = {
            "first_loss": summary["initial_loss"],
            "last_loss": summary["final_loss"],
            "eval_loss": summary["eval_loss"],
            "exported": sorted(path.name for path in (work / "adapters").iterdir()),
            "reply": reply,
        }
    print(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
