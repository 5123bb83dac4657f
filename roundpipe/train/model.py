"""The model `roundpipe train` trains: a preset, a config or a model directory, with optional
LoRA adapters. Apart from the loop so that building a model reads in one place."""

from __future__ import annotations

import warnings

import torch
from torch import nn

from roundpipe.data.text import BYTE_VOCAB
from roundpipe.errors import ModelError
from roundpipe.train.config import TrainConfig

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def build_model(config: TrainConfig) -> nn.Module:
    """The model ``config`` names (random init seeded by ``config.seed`` unless it is a directory
    with weights), wrapped in LoRA adapters on q/k/v/o (alpha = 2r) when ``lora_r`` is set."""
    from roundpipe.model import build_model as build

    model = build(config.model, seed=config.seed)
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if isinstance(vocab, int) and vocab < BYTE_VOCAB:
        raise ModelError(
            f"model {config.model!r} has a vocabulary of {vocab} tokens but the byte tokenizer needs {BYTE_VOCAB}"
        )
    if config.lora_r is not None:
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(
            r=config.lora_r,
            lora_alpha=2 * config.lora_r,
            lora_dropout=0.0,
            target_modules=list(LORA_TARGETS),
            task_type="CAUSAL_LM",
        )
        # peft draws the adapters' initial values from the global RNG: pin it to the seed so a
        # resumed run rebuilds the same model and the caller's RNG is left as it was.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(config.seed)
            with warnings.catch_warnings():
                # peft asks transformers a deprecated question; nothing the user can act on.
                warnings.filterwarnings(
                    "ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning
                )
                model = get_peft_model(model, lora)
    return model
