"""Small models and plain-PyTorch reference loops shared by the training tests.

The references are deliberately naive (one device, full batch, the textbook loop) so a bug in
roundpipe cannot hide in them.
"""

from __future__ import annotations

import copy
import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def sgd(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    """The tests' plain optimizer: SGD at lr 0.1."""
    return torch.optim.SGD(params, lr=0.1)


def sgd_momentum(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    """SGD at lr 0.1 with momentum 0.9: optimizer state that a wrong step order would show."""
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def mlp(seed: int = 0, width: int = 16, depth: int = 4, dropout: float = 0.0) -> nn.Sequential:
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(8, width), nn.Tanh()]
    for _ in range(depth - 2):
        layers += [nn.Linear(width, width), nn.Tanh()]
        if dropout:
            layers.append(nn.Dropout(dropout))
    layers.append(nn.Linear(width, 4))
    return nn.Sequential(*layers)


def batches(n: int, batch: int = 12, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 8, generator=g), torch.randn(batch, 4, generator=g)) for _ in range(n)]


def sync_reference(
    model: nn.Module,
    optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer],
    data: list[tuple[torch.Tensor, torch.Tensor]],
    loss_fn: LossFn,
) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    """The plain loop: loss on the full batch, backward, step, zero_grad. Returns the losses and
    the weights after every step."""
    opt = optimizer(list(model.parameters()))
    losses, weights = [], []
    for x, y in data:
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        weights.append(copy.deepcopy(model.state_dict()))
    return losses, weights


def async_reference(
    model: nn.Module,
    optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer],
    data: list[tuple[torch.Tensor, torch.Tensor]],
    loss_fn: LossFn,
) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    """Staleness 1: the gradient of iteration t is taken at the weights after step t-2 (the
    initial weights for t = 0, 1) and applied by the optimizer to the newest weights."""
    opt = optimizer(list(model.parameters()))
    history = [copy.deepcopy(model.state_dict())]  # history[k] = weights after k steps
    shadow = copy.deepcopy(model)
    losses, weights = [], []
    for t, (x, y) in enumerate(data):
        shadow.load_state_dict(history[max(0, t - 1)])
        shadow.zero_grad()
        loss = loss_fn(shadow(x), y)
        loss.backward()
        for p, s in zip(model.parameters(), shadow.parameters(), strict=True):
            p.grad = s.grad.clone()
        opt.step()
        opt.zero_grad()
        history.append(copy.deepcopy(model.state_dict()))
        losses.append(loss.item())
        weights.append(copy.deepcopy(model.state_dict()))
    return losses, weights


def train_steps(
    pipe: Any, data: list[tuple[torch.Tensor, torch.Tensor]], loss_fn: LossFn
) -> list[dict[str, torch.Tensor]]:
    """One forward_backward and step per batch on a RoundPipe, synchronised after each; the
    module's weights after every step (to compare with a reference loop's)."""
    weights = []
    for x, y in data:
        pipe.forward_backward(x, y, loss_fn)
        pipe.step()
        pipe.synchronize()
        weights.append({k: v.clone() for k, v in pipe.module.state_dict().items()})
    return weights


def assert_weights_equal(
    actual: dict[str, torch.Tensor],
    expected: dict[str, torch.Tensor],
    *,
    rtol: float = 1e-5,
    atol: float = 1e-6,
) -> None:
    assert actual.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(
            actual[name], expected[name], rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}"
        )


def tiny_causal_lm_config(
    kind: str = "qwen3", *, vocab: int = 64, tied: bool | None = None, layers: int = 2
) -> Any:
    """A transformers config of ``layers`` decoder layers small enough for a test step in milliseconds."""
    from transformers import LlamaConfig, Qwen3Config

    common = dict(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    if kind == "qwen3":
        return Qwen3Config(**common, head_dim=8, tie_word_embeddings=True if tied is None else tied)
    if kind == "llama":
        return LlamaConfig(**common, tie_word_embeddings=False if tied is None else tied)
    raise ValueError(f"unknown kind {kind!r}")


def tiny_causal_lm(
    kind: str = "qwen3", *, vocab: int = 64, attn: str = "eager", seed: int = 0, layers: int = 2
) -> nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(
        tiny_causal_lm_config(kind, vocab=vocab, layers=layers), attn_implementation=attn
    )


def tiny_model_dir(path: Any, *, kind: str = "qwen3", seed: int = 0) -> Any:
    """A model directory as people have one: weights, config and the model's own tokenizer (the
    BPE tokenizer shipped with roundpipe, saved as a real model's tokenizer is)."""
    from pathlib import Path

    from roundpipe.data.tokenizer import SHIPPED_TOKENIZER, load_tokenizer

    tokenizer = load_tokenizer(SHIPPED_TOKENIZER)
    model = tiny_causal_lm(kind, vocab=len(tokenizer), attn="sdpa", seed=seed)
    model.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    return Path(path)


def train_args(model_config: Path, out: Path, name: str, steps: int, *extra: str) -> list[str]:
    """`roundpipe train` argv for a tiny, fast run of the model config at ``model_config``."""
    return [
        "train", "--model", str(model_config), "--steps", str(steps), "--seq-len", "16",
        "--batch-size", "4", "--microbatches", "2", "--warmup-steps", "1", "--lr", "3e-3",
        "--devices", "cpu:1", "--out", str(out), "--name", name, *extra,
    ]  # fmt: skip


def metrics_logged(run: Path) -> list[dict[str, Any]]:
    """The lines of a run directory's metrics.jsonl."""
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def checkpoint_data_step(checkpoint: Path) -> int:
    """The data position a checkpoint resumes from."""
    return int(json.loads((checkpoint / "meta.json").read_text())["data_step"])


def in_another_thread(read: Callable[[], Any]) -> Any:
    """What ``read`` returns in a new thread: torch >= 2.12 keeps a config value per thread, and
    the layers compile on lane threads (and a backward on autograd's)."""
    seen: list[Any] = []
    thread = threading.Thread(target=lambda: seen.append(read()))
    thread.start()
    thread.join()
    return seen[0]
