"""The layer sequence: how a user's model becomes the list of layers the pipeline runs.

Supports ``nn.Sequential``, transformers Qwen3/Qwen2/Llama/Mistral/Gemma 3/Phi-3 causal LMs and the
Qwen3-MoE/GPT-OSS mixtures of experts (with a chunked LM-head loss, and the router auxiliary loss)
and peft LoRA models around them, plus tiny named presets for examples and tests.
Importing this package must stay cheap: transformers is imported only when a transformers model is
split or built. It must never copy the user's parameters.
"""

from roundpipe.model.loss import DEFAULT_CHUNK_TOKENS, chunked_cross_entropy
from roundpipe.model.presets import PRESETS, build_model, preset_config
from roundpipe.model.sequence import LayerSequence, to_layer_sequence

__all__ = [
    "DEFAULT_CHUNK_TOKENS",
    "PRESETS",
    "LayerSequence",
    "build_model",
    "chunked_cross_entropy",
    "preset_config",
    "to_layer_sequence",
]
