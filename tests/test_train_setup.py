"""What a new user meets first: the README's fine-tune command on ordinary chat data, options
checked before the data is read, an adapter export that loads from anywhere, and no other
library's progress bars or warnings in roundpipe's output."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from roundpipe.cli import main
from roundpipe.train.data import choose_seq_len

REPO = Path(__file__).resolve().parents[1]
NOISE = ("Loading weights", "Writing model shards", "Warning", "it/s]", "Failed to load")


def write_chats(path: Path, count: int, words: tuple[int, int], seed: int = 0) -> Path:
    """Conversations of one question and one answer, in the README's jsonl layout."""
    vocabulary = (REPO / "roundpipe" / "data" / "corpus.txt").read_text().split()[:4000]
    rng = random.Random(seed)

    def text(n: int) -> str:
        start = rng.randrange(len(vocabulary) - n)
        return " ".join(vocabulary[start : start + n])

    with open(path, "w") as f:
        for _ in range(count):
            messages = [
                {"role": "user", "content": text(rng.randint(6, 10))},
                {"role": "assistant", "content": text(rng.randint(*words))},
            ]
            f.write(json.dumps({"messages": messages}) + "\n")
    return path


def chat_model_dir(path: Path, positions: int) -> Path:
    """A two-layer Qwen3 directory with its own tokenizer and ``positions`` positions."""
    import torch
    from transformers import AutoModelForCausalLM

    from roundpipe.data.tokenizer import SHIPPED_TOKENIZER, load_tokenizer
    from tests.helpers import tiny_causal_lm_config

    tokenizer = load_tokenizer(SHIPPED_TOKENIZER)
    config = tiny_causal_lm_config("qwen3", vocab=len(tokenizer))
    config.max_position_embeddings = positions
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def readme_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """The README's fine-tune command, as typed (a relative model path, no --seq-len), on chats of
    about 80-120 tokens, in a fresh process so that everything it prints is seen."""
    work = tmp_path_factory.mktemp("readme")
    chat_model_dir(work / "tiny-model", positions=512)
    write_chats(work / "chats.jsonl", 24, (50, 80))
    command = [
        sys.executable, "-m", "roundpipe.cli", "train", "--model", "tiny-model", "--data", "chats.jsonl",
        "--lora-r", "4", "--packing", "--eval-split", "0.1", "--eval-every", "2", "--export", "out/model",
        "--steps", "2", "--batch-size", "4", "--microbatches", "2", "--devices", "cpu:1", "--name", "r", "--json",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "COLUMNS": "100"}
    done = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True, timeout=300)
    return work, done


def test_readme_command_chooses_the_length_from_the_data(
    readme_run: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    work, done = readme_run
    assert done.returncode == 0, done.stderr
    meta = json.loads((work / "runs" / "r" / "checkpoint" / "meta.json").read_text())
    seq_len = meta["extra"]["train_config"]["seq_len"]
    assert seq_len is not None and seq_len > 64  # saved resolved: a resume cuts the data the same way
    assert f"--seq-len {seq_len}, chosen from the data" in done.stderr
    assert "the model takes 512" in done.stderr
    assert "2 steps of 4 rows: " in done.stderr and " epochs" in done.stderr


def test_tokens_per_s_counts_real_tokens(readme_run: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    """Packed rows are partly padding: the rate counts the examples' tokens, and the fill says
    how much of each row they take."""
    work, done = readme_run
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    rows = [json.loads(line) for line in (work / "runs" / "r" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "fill" in r]
    assert len(steps) == 2 and all(0 < r["fill"] < 1 for r in steps)
    assert summary["fill"] == pytest.approx(sum(r["fill"] for r in steps) / 2)
    seq_len = json.loads((work / "runs" / "r" / "checkpoint" / "meta.json").read_text())["extra"][
        "train_config"
    ]["seq_len"]
    real = summary["fill"] * 2 * 4 * seq_len
    assert summary["tokens_per_s"] * summary["elapsed_s"] == pytest.approx(real, rel=1e-6)
    assert "rows filled" in done.stderr


def test_no_other_library_prints_into_the_run(
    readme_run: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    _, done = readme_run
    assert done.returncode == 0, done.stderr
    for noise in NOISE:
        assert noise not in done.stdout + done.stderr, (noise, done.stderr)


def test_adapter_export_loads_from_another_directory(
    readme_run: tuple[Path, subprocess.CompletedProcess[str]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    work, done = readme_run
    assert done.returncode == 0, done.stderr
    export = work / "out" / "model"
    base = json.loads((export / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert base == str((work / "tiny-model").resolve())
    monkeypatch.chdir(tmp_path)  # where "tiny-model" means nothing
    from peft import AutoPeftModelForCausalLM

    model = AutoPeftModelForCausalLM.from_pretrained(str(export))
    assert type(model.base_model.model).__name__ == "Qwen3ForCausalLM"


@pytest.mark.parametrize(
    ("lengths", "positions", "packing", "expected"),
    [
        ([80, 118, 95], 512, False, 128),  # the longest, to a multiple of 16
        ([80, 118, 95], 512, True, 128),  # a power of two already
        ([80, 130, 95], 512, True, 256),  # packed rows: a power of two
        ([80, 130, 95], 512, False, 144),
        ([80, 900], 512, False, 512),  # never beyond the model's positions
        ([10], None, False, 16),
    ],
)
def test_choose_seq_len(lengths: list[int], positions: int | None, packing: bool, expected: int) -> None:
    assert choose_seq_len(lengths, positions, packing) == expected


def test_too_long_for_the_model_names_its_positions(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = chat_model_dir(tmp_path / "m", positions=32)
    data = write_chats(tmp_path / "chats.jsonl", 3, (40, 50))
    assert main(["train", "--model", str(model), "--data", str(data), "--out", str(tmp_path / "runs")]) == 2
    err = capsys.readouterr().err
    assert "more than the model's 32 positions (max_position_embeddings" in err, err
    assert "pass --truncation" in err
    assert not (tmp_path / "runs").exists()


def test_mistyped_model_is_reported_before_the_data_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import roundpipe.train.trainer as loop

    def must_not_run(*args: object, **kwargs: object) -> None:
        raise AssertionError("the data or the tokenizer was read before --model was checked")

    monkeypatch.setattr(loop, "prepare_data", must_not_run)
    monkeypatch.setattr(loop, "build_tokenizer", must_not_run)
    (tmp_path / "tiny-model").mkdir()
    (tmp_path / "tiny-model" / "config.json").write_text('{"model_type": "qwen3"}')
    data = write_chats(tmp_path / "chats.jsonl", 2, (5, 6))
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--model", "./tiny-modle", "--data", str(data)]) == 2
    err = capsys.readouterr().err
    assert "unknown model './tiny-modle' (--model): no such directory or file, and not a preset" in err
    assert "did you mean 'tiny-model'?" in err
    assert main(["train", "--model", "tiny-model", "--data", "chat.jsonl"]) == 2
    assert "--data 'chat.jsonl': no such file" in capsys.readouterr().err
    assert main(["train", "--model", "tiny-model", "--data", str(data), "--resume", "nowhere"]) == 2
    assert "nowhere" in capsys.readouterr().err


def test_the_quickstart_lora_snippet_prints_nothing_foreign(tmp_path: Path) -> None:
    """docs/quickstart.md's LoRA lines (peft wrapping a model, saving and loading adapters): none
    of peft's, transformers' or bitsandbytes' messages about each other reach the user."""
    script = """
import roundpipe
from peft import LoraConfig, PeftModel, get_peft_model
from roundpipe.model import build_model
lora = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"])
model = get_peft_model(build_model("qwen3-tiny"), lora)
model.save_pretrained("adapters")
PeftModel.from_pretrained(build_model("qwen3-tiny"), "adapters")
print("done")
"""
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout.strip() == "done", done.stderr
    for noise in NOISE:
        assert noise not in done.stderr, done.stderr


def test_loading_a_model_directory_draws_no_foreign_bar(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    from roundpipe.model import build_model

    model_dir = chat_model_dir(tmp_path / "m", positions=64)
    capfd.readouterr()
    build_model(str(model_dir))
    captured = capfd.readouterr()
    assert "Loading weights" not in captured.err + captured.out
