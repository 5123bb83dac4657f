"""The run's tokenizer: a model directory's own, the shipped BPE one for presets, bytes on request."""

from __future__ import annotations

from pathlib import Path

import pytest

from roundpipe.cli import main
from roundpipe.data.tokenizer import SHIPPED_TOKENIZER, ByteLevelTokenizer, build_shipped, load_tokenizer
from roundpipe.train import make_config
from roundpipe.train.model import build_model, build_tokenizer, tokenizer_source
from tests.helpers import tiny_causal_lm, tiny_causal_lm_config, tiny_model_dir


def test_shipped_tokenizer_is_what_the_code_builds(tmp_path: Path) -> None:
    build_shipped(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / name).read_bytes() == (SHIPPED_TOKENIZER / name).read_bytes(), name
    tok = load_tokenizer(SHIPPED_TOKENIZER)
    assert len(tok) == 1024 and tok.eos_token == tok.pad_token == "<|endoftext|>"
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n"
    ids = tok.encode("Call me Ishmael.", add_special_tokens=False)
    assert len(ids) < 16 and tok.decode(ids) == "Call me Ishmael."


def test_presets_and_configs_use_the_shipped_tokenizer(tmp_path: Path) -> None:
    assert tokenizer_source(make_config({})) == (str(SHIPPED_TOKENIZER), False)
    path = tmp_path / "config.json"
    tiny_causal_lm_config("qwen3", vocab=64).to_json_file(str(path))
    config = make_config({"model": str(path)})
    assert tokenizer_source(config) == (str(SHIPPED_TOKENIZER), False)
    model = build_model(config, build_tokenizer(config))
    assert model.config.vocab_size == 1024  # a random init is sized to its tokenizer
    byte = make_config({"model": str(path), "tokenizer": "byte"})
    assert isinstance(build_tokenizer(byte), ByteLevelTokenizer)
    assert build_model(byte, ByteLevelTokenizer()).config.vocab_size == 256


def test_model_directory_brings_its_own_tokenizer(tmp_path: Path) -> None:
    """(The run on such a directory, and its export with the tokenizer: test_data_examples.py.)"""
    model_dir = tiny_model_dir(tmp_path / "model")
    config = make_config({"model": str(model_dir)})
    assert tokenizer_source(config) == (str(model_dir), True)
    assert build_tokenizer(config).chat_template == load_tokenizer(SHIPPED_TOKENIZER).chat_template


def test_tokenizer_errors_name_the_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bare = tmp_path / "bare"
    bare.mkdir()
    tiny_causal_lm_config("qwen3", vocab=1024).to_json_file(str(bare / "config.json"))
    assert main(["train", "--model", str(bare), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"{bare} holds no tokenizer" in err and "--tokenizer" in err
    small = tmp_path / "small"
    tiny_causal_lm("qwen3", vocab=256).save_pretrained(str(small))
    load_tokenizer(SHIPPED_TOKENIZER).save_pretrained(str(small))
    assert main(["train", "--model", str(small), "--out", str(tmp_path)]) == 2
    assert "has a vocabulary of 256 tokens but its tokenizer" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()
