"""Which tokenizer a run uses, and the small real BPE tokenizer shipped with roundpipe.

A model trained on ids from the wrong tokenizer is useless, so a model directory is always trained
with the tokenizer saved beside its weights (`transformers.AutoTokenizer`, with its special tokens
and chat template). Models built from a preset or a bare config.json have no tokenizer of their
own; they get the one in ``roundpipe/data/tokenizer/``: a byte-level BPE of 1024 tokens learnt
from the shipped corpus, with ChatML special tokens and a chat template. It loads through the same
`AutoTokenizer` call as a real model's tokenizer, so the default run and the tests take the path a
real model takes. ``python -m roundpipe.data.tokenizer`` rebuilds it (deterministic; the test
suite checks the shipped files are what this code builds).

``"byte"`` keeps the old byte-level tokenizer (256 ids, no special tokens, no chat template) for
the tiny presets. This module must never download anything: every load is ``local_files_only``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from roundpipe.data.text import BYTE_VOCAB, load_corpus
from roundpipe.errors import ModelError

SHIPPED_TOKENIZER = Path(__file__).with_name("tokenizer")
BYTE = "byte"
SHIPPED_VOCAB = 1024
EOS = "<|endoftext|>"
CHAT_SPECIALS = ("<|im_start|>", "<|im_end|>")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# ChatML, as Qwen writes it; `{% generation %}` is left out on purpose: real templates rarely
# have it, and the data code finds the assistant turns without it (see `roundpipe.data.examples`).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class ByteLevelTokenizer:
    """The byte tokenizer behind the few calls the data code makes of a transformers tokenizer."""

    eos_token_id: int | None = None
    pad_token_id: int | None = 0
    chat_template: str | None = None
    name_or_path = BYTE

    def __len__(self) -> int:
        return BYTE_VOCAB

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def __call__(self, text: str, **kwargs: Any) -> dict[str, list[Any]]:
        """Ids and, per id, the character span it came from (as a fast tokenizer's offsets)."""
        ids: list[int] = []
        offsets: list[tuple[int, int]] = []
        for i, char in enumerate(text):
            encoded = char.encode("utf-8")
            ids.extend(encoded)
            offsets.extend([(i, i + 1)] * len(encoded))
        return {"input_ids": ids, "offset_mapping": offsets}

    def save_pretrained(self, path: str | os.PathLike[str]) -> tuple[str, ...]:
        return ()  # nothing transformers could load: the exported model documents its byte ids


def has_tokenizer(directory: Path) -> bool:
    return directory.is_dir() and any((directory / name).is_file() for name in TOKENIZER_FILES)


def load_tokenizer(path: str | os.PathLike[str]) -> Any:
    """``"byte"``, or the transformers tokenizer saved in directory ``path`` (never downloaded)."""
    if os.fspath(path) == BYTE:
        return ByteLevelTokenizer()
    directory = Path(path)
    if not has_tokenizer(directory):
        raise ModelError(
            f"{directory} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}); save one there with "
            "tokenizer.save_pretrained(DIR), or pass --tokenizer DIR (or --tokenizer byte for a preset)"
        )
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ModelError(f"{directory}: transformers cannot load its tokenizer ({exc})") from None


def train_bpe(
    text: str, vocab_size: int = SHIPPED_VOCAB, specials: Sequence[str] = (EOS, *CHAT_SPECIALS)
) -> Any:
    """A byte-level BPE tokenizer of ``vocab_size`` ids learnt from ``text`` (deterministic), as a
    `transformers.PreTrainedTokenizerFast` with ``specials`` first, EOS = padding, ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator([text], trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token=EOS,
        pad_token=EOS,
        additional_special_tokens=list(specials[1:]),
        chat_template=CHAT_TEMPLATE,
        model_max_length=1 << 20,
    )


def build_shipped(directory: Path = SHIPPED_TOKENIZER) -> Path:
    """Learn the shipped tokenizer from the shipped corpus and save it in ``directory``: its
    tokenizer.json and a tokenizer_config.json that transformers 4.53 and later all read (the
    one transformers 5 writes names classes that 4.x does not have)."""
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = train_bpe(load_corpus())
    tokenizer.backend_tokenizer.save(str(directory / "tokenizer.json"))
    settings = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS,
        "pad_token": EOS,
        "additional_special_tokens": list(CHAT_SPECIALS),
        "model_max_length": 1 << 20,
        "chat_template": CHAT_TEMPLATE,
    }
    text = json.dumps(settings, indent=2, sort_keys=True) + "\n"
    (directory / "tokenizer_config.json").write_text(text, encoding="utf-8")
    return directory


if __name__ == "__main__":
    print(f"wrote {build_shipped()}")


__all__ = [
    "BYTE",
    "CHAT_TEMPLATE",
    "SHIPPED_TOKENIZER",
    "ByteLevelTokenizer",
    "build_shipped",
    "has_tokenizer",
    "load_tokenizer",
    "train_bpe",
]
