"""Turn a user's model into the layer sequence the pipeline runs.

The engine never sees the user's model class: it sees a list of layers, each called with exactly one
positional argument (layer 0 gets the microbatch inputs, every next layer the previous output). This
module is the one place that decides how a model becomes such a list: an ``nn.Sequential`` child by
child, a supported transformers causal LM through its preset, a peft model through its base model.

Activation convention: a layer's output is a tensor or a tuple/dict of tensors. Floating-point
tensors are differentiable (the engine sends their gradients back across stage boundaries);
integer/bool tensors are not; in a dict, keys starting with ``"_"`` are constants (rotary tables,
masks, labels) carried unchanged and never differentiated.

It must never copy or re-create parameters: the layers reference the user's own modules, so
training them trains the user's model, frozen parameters stay frozen, and a parameter shared by two
layers (tied embeddings) is the same ``nn.Parameter`` object in both.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from torch import nn

from roundpipe.errors import ModelError


@dataclass
class LayerSequence:
    """A model as consecutive layers, shallow first.

    ``layers`` reference the user's parameters (no copies); ``names`` label them ("embed",
    "block.0", ..., "head"); ``source`` is the module the user passed; ``computes_loss`` is True when
    the last layer returns the scalar loss itself (then the user passes ``loss_fn=None``).
    """

    layers: list[nn.Module]
    names: list[str]
    source: nn.Module
    computes_loss: bool

    def __post_init__(self) -> None:
        if not self.layers:
            raise ModelError("a layer sequence needs at least one layer")
        if len(self.layers) != len(self.names):
            raise ModelError(
                f"got {len(self.layers)} layers but {len(self.names)} names; give one name per layer"
            )
        if len(set(self.names)) != len(self.names):
            raise ModelError(f"layer names must be unique, got {self.names}")
        for name, layer in zip(self.names, self.layers, strict=True):
            if not isinstance(layer, nn.Module):
                raise ModelError(f"layer {name!r} is a {type(layer).__name__}, not an nn.Module")

    def __len__(self) -> int:
        return len(self.layers)


def _unwrap_peft(model: nn.Module) -> nn.Module | None:
    """The transformers model inside a peft ``PeftModel``, or None when ``model`` is not one."""
    peft = sys.modules.get("peft")  # a PeftModel exists only if peft is already imported
    if peft is None or not isinstance(model, peft.PeftModel):
        return None
    base = model.get_base_model()
    if not isinstance(base, nn.Module):
        raise ModelError(f"the PeftModel's base model is a {type(base).__name__}, not an nn.Module")
    return base


def _unsupported(model: nn.Module) -> ModelError:
    from roundpipe.model.transformers_presets import SUPPORTED_CAUSAL_LM_CLASSES

    return ModelError(
        f"roundpipe cannot split a {type(model).__module__}.{type(model).__name__} into layers. Supported: "
        f"nn.Sequential (each child is one layer), transformers {', '.join(SUPPORTED_CAUSAL_LM_CLASSES)}, "
        "and a peft PeftModel wrapping one of those. For any other model, pass an nn.Sequential whose "
        "children run one after the other, each taking the previous child's output as its single "
        "argument (a tensor, or a tuple/dict of tensors), e.g. nn.Sequential(embed, *blocks, head)"
    )


def to_layer_sequence(
    model: nn.Module | LayerSequence, *, loss_chunk_tokens: int | None = None
) -> LayerSequence:
    """Split ``model`` into its layer sequence (see the module docstring for what is supported).

    ``loss_chunk_tokens`` is how many tokens the transformers head turns into logits at once
    (None: as many as keep a chunk of logits at 32M values, at most 1024).
    A ``LayerSequence`` is returned unchanged.
    """
    if isinstance(model, LayerSequence):
        return model
    if not isinstance(model, nn.Module):
        raise ModelError(f"expected an nn.Module, got {type(model).__name__}")

    if isinstance(model, nn.Sequential):
        if len(model) == 0:
            raise ModelError("the nn.Sequential is empty; it needs at least one child module (one per layer)")
        names = [name for name, _ in model.named_children()]
        layers = [child for _, child in model.named_children()]
        return LayerSequence(layers=layers, names=names, source=model, computes_loss=False)

    from roundpipe.model.transformers_presets import causal_lm_layers, supported_class_name

    base = _unwrap_peft(model)
    target = base if base is not None else model
    if supported_class_name(target) is None:
        if base is not None:
            raise ModelError(
                f"the PeftModel wraps a {type(base).__name__}; roundpipe supports peft models only around "
                "a supported causal LM. " + str(_unsupported(base))
            )
        raise _unsupported(model)
    layers, names = causal_lm_layers(target, loss_chunk_tokens)
    return LayerSequence(layers=layers, names=names, source=model, computes_loss=True)
