"""The model `roundpipe train` trains and the tokenizer that goes with it: a preset, a config or a
model directory, with optional LoRA adapters. Apart from the loop so that building a model reads
in one place.

A model directory brings its own tokenizer; a model built from a preset or a bare config.json is
randomly initialised, so its vocabulary is sized to the tokenizer it will be trained with (the BPE
tokenizer shipped with roundpipe unless ``--tokenizer`` names another). Loaded weights keep their
vocabulary, which must then cover every id the tokenizer can produce.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from roundpipe.data.tokenizer import SHIPPED_TOKENIZER, has_tokenizer, load_tokenizer
from roundpipe.errors import ModelError
from roundpipe.train.config import TrainConfig

if TYPE_CHECKING:
    from roundpipe.model.loading import LoadProgress, LoadReport

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def tokenizer_source(config: TrainConfig) -> tuple[str, bool]:
    """Where the run's tokenizer comes from, and whether it belongs to the model (then the model's
    vocabulary is kept; otherwise a random-init model is sized to the tokenizer)."""
    if config.tokenizer is not None:
        return config.tokenizer, False
    path = Path(config.model).expanduser()
    if path.is_dir():
        return str(path), True  # load_tokenizer says how to fix a directory without one
    if path.is_file() and has_tokenizer(path.parent):
        return str(path.parent), True
    return str(SHIPPED_TOKENIZER), False


def build_tokenizer(config: TrainConfig) -> Any:
    """The tokenizer the run trains with (see `tokenizer_source`)."""
    return load_tokenizer(tokenizer_source(config)[0])


def build_model(config: TrainConfig, tokenizer: Any | None = None, reporter: Any | None = None) -> nn.Module:
    """The model ``config`` names (random init seeded by ``config.seed`` unless it is a directory
    with weights), wrapped in LoRA adapters on q/k/v/o (alpha = 2r) when ``lora_r`` is set (and on
    the experts' weights with ``lora_experts``). A
    random-init model without a tokenizer of its own gets the vocabulary of ``tokenizer``.

    A directory of safetensors weights loads shard by shard (`load_model_dir`); ``reporter`` (the
    run's, when it draws on a rich console) shows the load."""
    from roundpipe.model import build_model as build
    from roundpipe.model.presets import WEIGHT_FILES
    from roundpipe.model.shards import is_safetensors_checkpoint

    if tokenizer is None:
        tokenizer = build_tokenizer(config)
    path = Path(config.model).expanduser()
    has_weights = path.is_dir() and any((path / w).is_file() for w in WEIGHT_FILES)
    if has_weights and is_safetensors_checkpoint(path):
        return load_model_dir(config, path, tokenizer, reporter)
    own = tokenizer_source(config)[1]
    vocab_size = None if has_weights or own else len(tokenizer)
    with quiet_transformers():
        model = build(config.model, vocab_size=vocab_size, seed=config.seed)
    check_vocabulary(model, config, tokenizer)
    return add_lora(model, config) if config.lora_r is not None else model


def check_vocabulary(model: nn.Module, config: TrainConfig, tokenizer: Any) -> None:
    """`ModelError` when the model cannot embed every id the tokenizer produces."""
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if isinstance(vocab, int) and vocab < len(tokenizer):
        raise ModelError(
            f"model {config.model!r} has a vocabulary of {vocab} tokens but its tokenizer "
            f"({tokenizer_source(config)[0]}) has {len(tokenizer)}; pass the tokenizer the model was "
            "trained with (--tokenizer DIR)"
        )


def add_lora(model: nn.Module, config: TrainConfig) -> nn.Module:
    """``model`` wrapped by peft in the run's LoRA adapters, drawn from ``config.seed``."""
    from peft import LoraConfig, get_peft_model

    rank = config.lora_r
    assert rank is not None
    experts: dict[str, Any] = expert_parameters(model, config.model) if config.lora_experts else {}
    lora = LoraConfig(
        r=rank,
        lora_alpha=2 * rank,
        lora_dropout=0.0,
        target_modules=list(LORA_TARGETS),
        task_type="CAUSAL_LM",
        **experts,
    )
    # peft draws the adapters' initial values from the global RNG: pin it to the seed so a
    # resumed run rebuilds the same model and the caller's RNG is left as it was.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        with warnings.catch_warnings():
            # peft asks transformers a deprecated question; nothing the user can act on.
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            wrapped: nn.Module = get_peft_model(model, lora)
        if any(p.device.type == "meta" for p in wrapped.parameters() if p.requires_grad):
            _materialize_adapters(wrapped, lora.init_lora_weights)
    return wrapped


def _materialize_adapters(model: nn.Module, init: Any) -> None:
    """Adapters that peft placed on the meta device beside a skeleton's base layers, made real
    and initialised as peft initialises them (the base layers stay meta until loaded)."""
    for module in model.modules():
        reset = getattr(module, "reset_lora_parameters", None)
        if reset is None:
            continue
        for attr in getattr(module, "adapter_layer_names", ()):
            container = getattr(module, attr, None)
            if isinstance(container, nn.Module):
                container.to_empty(device="cpu")
        for adapter in list(getattr(module, "lora_A", {}).keys()):
            reset(adapter, init)
    left = [n for n, p in model.named_parameters() if p.requires_grad and p.device.type == "meta"]
    if left:
        raise ModelError(
            f"LoRA adapters {', '.join(left[:3])} cannot be initialised before the base is loaded "
            "(--base-format nf4 adds them to the unloaded model); use the default LoRA settings "
            "or --base-format compute"
        )


def load_model_dir(config: TrainConfig, path: Path, tokenizer: Any, reporter: Any | None = None) -> nn.Module:
    """The model saved in ``path`` (safetensors), loaded shard by shard (`roundpipe.model.loading`):
    trainable weights in fp32 (they are the optimizer copy), a LoRA run's frozen base in the
    compute precision, as views of the files where that is their dtype.

    LoRA goes on in the order that keeps one copy: after loading for a base in the compute
    precision (peft wraps the loaded layers without copying them); with ``base_format="nf4"``
    onto the skeleton first (peft cannot wrap a 4-bit layer), so that each base layer is
    quantized as its shard arrives and the dense base is never whole in memory."""
    from roundpipe.model.loading import load_skeleton_config, load_weights, model_skeleton
    from roundpipe.optim.host import PRECISION_DTYPES

    lora = config.lora_r is not None
    nf4 = lora and config.base_format == "nf4"
    model = model_skeleton(load_skeleton_config(path))
    check_vocabulary(model, config, tokenizer)
    target = model
    if nf4:
        model = add_lora(model, config)
        target = model.get_base_model()  # type: ignore[operator]
    with load_display(reporter) as progress:
        report = load_weights(
            target,
            path,
            dtype=torch.float32,
            frozen=lora,
            frozen_dtype=PRECISION_DTYPES[config.precision] if lora else None,
            base_format="nf4" if nf4 else "compute",
            progress=progress,
        )
    model.eval()
    if lora and not nf4:
        model = add_lora(model, config)
    if reporter is not None:
        reporter.note(load_summary(report))
    return model


def load_summary(report: LoadReport) -> str:
    gb = 1e9
    text = (
        f"loaded {report.file_bytes / gb:.2f} GB from {report.files} file(s) in {report.seconds:.1f} s "
        f"({report.rate_gbps():.2f} GB/s): {report.mapped_bytes / gb:.2f} GB mapped from the files, "
        f"{report.copied_bytes / gb:.2f} GB copied"
    )
    if report.quantized_bytes:
        text += f", {report.quantized_bytes / gb:.2f} GB quantized to {report.nf4_bytes / gb:.2f} GB of nf4"
    return text


@contextmanager
def quiet_transformers() -> Iterator[None]:
    """transformers' own progress bars off while it loads (the run draws its own)."""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


@contextmanager
def load_display(reporter: Any | None) -> Iterator[Callable[[LoadProgress], None] | None]:
    """A progress bar of the load on the reporter's rich console (None without one: a caller
    from Python sees nothing unless its reporter draws)."""
    console = getattr(reporter, "console", None)
    if console is None:
        yield None
        return
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

    bar = Progress(
        TextColumn("[bold blue]loading"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TextColumn("{task.fields[file]}"),
        console=console,
        transient=True,
    )
    task = bar.add_task("load", total=None, file="")

    def show(state: LoadProgress) -> None:
        bar.update(
            task,
            total=state.bytes_total,
            completed=state.bytes_done,
            file=f"shard {state.file_index + 1}/{state.files}",
        )

    with bar:
        yield show


def expert_parameters(model: nn.Module, name: str) -> dict[str, list[str]]:
    """``target_parameters`` for peft's LoRA on a mixture-of-experts model's expert weights: the
    3-D parameters of its ``experts`` modules (one matrix per expert), which are no ``nn.Linear``
    and so cannot be named in ``target_modules``."""
    from peft import LoraConfig

    leaves = sorted(
        {
            f"experts.{leaf}"
            for full, param in model.named_parameters()
            for owner, _, leaf in [full.rpartition(".")]
            if param.dim() == 3 and owner.rpartition(".")[2] == "experts"
        }
    )
    if not leaves:
        raise ModelError(
            f"--lora-experts: model {name!r} ({type(model).__name__}) has no expert weights; it applies to "
            "mixture-of-experts models (Qwen3MoeForCausalLM, GptOssForCausalLM)"
        )
    if "target_parameters" not in LoraConfig.__dataclass_fields__:
        raise ModelError(
            "--lora-experts needs peft >= 0.17 (LoraConfig.target_parameters): pip install -U peft"
        )
    return {"target_parameters": leaves}
