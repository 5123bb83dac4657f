"""Records as people have them (text, prompt/completion, conversations) into examples and batches."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from roundpipe.cli import main
from roundpipe.data.batching import ExampleBatches, collate, pack
from roundpipe.data.examples import IGNORE_INDEX, Example, load_examples
from roundpipe.data.tokenizer import SHIPPED_TOKENIZER, load_tokenizer

CHATS = [
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Who is Ishmael?"},
        {"role": "assistant", "content": "A sailor."},
        {"role": "user", "content": "And Ahab?"},
        {"role": "assistant", "content": "The captain."},
    ],
    [{"role": "user", "content": "Call me?"}, {"role": "assistant", "content": "Ishmael."}],
]


@pytest.fixture(scope="module")
def tok() -> Any:
    return load_tokenizer(SHIPPED_TOKENIZER)


def write_jsonl(path: Path, records: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def labeled(example: Example) -> list[int]:
    return [label for label in example.labels if label != IGNORE_INDEX]


def test_conversations_train_on_assistant_turns_only(tmp_path: Path, tok: Any) -> None:
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in CHATS])
    examples = load_examples(path, tok)
    for example, chat in zip(examples, CHATS, strict=True):
        rendered = tok.apply_chat_template(chat, tokenize=False)
        assert tok.decode(example.ids) == rendered
        answers = "".join(m["content"] + "<|im_end|>\n" for m in chat if m["role"] == "assistant")
        assert tok.decode(labeled(example)) == answers  # every assistant token, nothing else
    everything = load_examples(path, tok, train_on_inputs=True)
    assert [e.trainable for e in everything] == [len(e.ids) - 1 for e in everything]


def test_prompt_completion_and_text_in_every_file_format(tmp_path: Path, tok: Any) -> None:
    import pandas as pd

    rows = [{"question": "Call me", "answer": " Ishmael."}, {"question": "The whale", "answer": " is white."}]
    frame = pd.DataFrame(rows)
    frame.to_parquet(tmp_path / "qa.parquet")
    frame.to_csv(tmp_path / "qa.csv", index=False)
    (tmp_path / "qa.json").write_text(json.dumps(rows))
    fields = {"prompt": "question", "completion": "answer"}
    for name in ("qa.parquet", "qa.csv", "qa.json"):
        examples = load_examples(tmp_path / name, tok, fields=fields)
        assert tok.decode(labeled(examples[0])) == " Ishmael.<|endoftext|>", name
        assert tok.decode(examples[1].ids) == "The whale is white.<|endoftext|>"
    text = load_examples(write_jsonl(tmp_path / "t.jsonl", [{"text": "Call me Ishmael."}]), tok)
    assert (
        tok.decode(text[0].ids) == "Call me Ishmael.<|endoftext|>"
        and text[0].trainable == len(text[0].ids) - 1
    )


def test_padded_batches_carry_no_loss_on_padding_and_resume_exactly(tok: Any) -> None:
    examples = [Example(list(range(1, n + 1)), [IGNORE_INDEX, *range(2, n + 1)]) for n in (3, 5, 2, 4, 6)]
    batches = ExampleBatches(examples, seq_len=8, batch_size=2, seed=0, pad_id=0, packing=False)
    batch = batches.batch(0)
    assert set(batch) == {"input_ids", "labels", "attention_mask"}
    padding = batch["attention_mask"] == 0
    assert (batch["labels"][padding] == IGNORE_INDEX).all() and (batch["input_ids"][padding] == 0).all()
    seen = [batches.batch(s)["input_ids"].tolist() for s in range(6)]  # crosses two epochs
    again = ExampleBatches(examples, seq_len=8, batch_size=2, seed=0, pad_id=0, packing=False)
    assert [again.batch(s)["input_ids"].tolist() for s in (5, 3)] == [seen[5], seen[3]]
    rows = pack(examples, 8)
    assert [[len(e.ids) for e in row] for row in rows] == [[3, 5], [2, 4], [6]]
    packed = collate(rows, 8, 0, packed=True)
    assert packed["position_ids"][0].tolist() == [0, 1, 2, 0, 1, 2, 3, 4]
    assert packed["position_ids"][2].tolist() == [0, 1, 2, 3, 4, 5, 0, 1]  # padding: its own block


BAD = [
    ({"text": "ok"}, {"text": 5}, "bad.jsonl:2: field 'text' must be a string, got a int"),
    (
        {"prompt": "a", "completion": "b"},
        {"prompt": "a"},
        "bad.jsonl:2: field 'completion' must be a string, got missing",
    ),
    (
        {"messages": CHATS[1]},
        {"messages": [{"role": "narrator", "content": "x"}]},
        "bad.jsonl:2: field 'messages'[0].role is 'narrator'",
    ),
    ({"text": "ok"}, {"text": "word " * 40}, "bad.jsonl:2: the example has"),
]


@pytest.mark.parametrize(("good", "bad", "message"), BAD)
def test_bad_records_exit_2_naming_file_line_and_field(
    good: dict, bad: dict, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(
        json.dumps(good) + "\n\n" + json.dumps(bad) + "\n"
    )  # a blank line is skipped, not counted
    message = message.replace("bad.jsonl:2", f"{path}:3")
    assert main(["train", "--data", str(path), "--seq-len", "32", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("roundpipe: error: ") and message in err and err.count("\n") == 1, err
    assert not (tmp_path / "runs").exists()


def test_dataset_level_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cases = [
        (write_jsonl(tmp_path / "empty.jsonl", []), [], "holds no records"),
        (
            write_jsonl(tmp_path / "chat.jsonl", [{"messages": CHATS[1]}]),
            ["--tokenizer", "byte"],
            "no chat template",
        ),
        (
            write_jsonl(tmp_path / "masked.jsonl", [{"prompt": "a question", "completion": ""}]),
            ["--tokenizer", "byte"],
            "no token to train on",
        ),
        (write_jsonl(tmp_path / "cols.jsonl", [{"body": "x"}]), [], "no column to train on"),
    ]
    for path, extra, message in cases:
        assert main(["train", "--data", str(path), *extra, "--out", str(tmp_path)]) == 2, message
        err = capsys.readouterr().err
        assert str(path) in err and message in err, err


def test_train_on_a_conversation_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tests.helpers import tiny_model_dir

    model = tiny_model_dir(tmp_path / "model")
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in CHATS * 3])
    args = ["train", "--model", str(model), "--data", str(path), "--steps", "2", "--seq-len", "64"]
    args += ["--truncation", "--batch-size", "2", "--microbatches", "2", "--out", str(tmp_path)]
    args += ["--name", "chat", "--json", "--packing", "--eval-split", "0.34", "--eval-every", "1"]
    args += ["--export", str(tmp_path / "hf")]
    assert main(args) == 0
    out = capsys.readouterr()
    assert f"{path}: 4 examples, " in out.err and "packed rows of 64" in out.err
    assert "2 held out to evaluate" in out.err
    summary = json.loads(out.out.strip().splitlines()[-1])
    assert summary["steps"] == 2 and summary["final_loss"] > 0
    rows = [json.loads(line) for line in (tmp_path / "chat" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval_loss" in r]
    assert [r["step"] for r in evals] == [1, 2]  # every step, and the end is not evaluated twice
    assert summary["eval_loss"] == evals[-1]["eval_loss"] and summary["eval_perplexity"] > 1
    # Logging where people look: TensorBoard events and the loss curve in the run directory.
    run = tmp_path / "chat"
    assert (run / "loss.png").read_bytes().startswith(b"\x89PNG") and (run / "timeline.png").exists()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2]
    assert [e.value for e in events.Scalars("eval/loss")] == pytest.approx([r["eval_loss"] for r in evals])
    # The export loads whole with transformers: the model and the tokenizer it was trained with.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    exported = AutoTokenizer.from_pretrained(str(tmp_path / "hf"), local_files_only=True)
    assert exported.apply_chat_template(CHATS[1], tokenize=False).startswith("<|im_start|>user")
    assert AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).config.vocab_size == len(exported)


def test_a_hub_name_is_read_through_datasets_and_an_unreachable_hub_is_one_clear_line(
    monkeypatch: pytest.MonkeyPatch, tok: Any
) -> None:
    """``--data owner/name`` that is no local file asks the hub through `datasets` (its cache
    where offline); here the hub is stood in for by a patched `datasets.load_dataset`."""
    import datasets

    from roundpipe.data.examples import HubDataset, load_examples, looks_like_hub_name
    from roundpipe.errors import DataError
    from roundpipe.train.config import TrainConfig
    from roundpipe.train.data import data_path

    assert looks_like_hub_name("someone/chat") and looks_like_hub_name("squad")
    assert not any(map(looks_like_hub_name, ["a/b/c", "data.jsonl", "./x", "~/x", "notes.txt"]))
    assert data_path(TrainConfig(data="someone/chat")) == HubDataset("someone/chat")
    asked: list[tuple[str, str]] = []

    def fake_hub(name: str, split: str) -> datasets.Dataset:
        asked.append((name, split))
        if name != "someone/chat":
            raise ConnectionError("Couldn't reach the Hugging Face Hub")
        return datasets.Dataset.from_list([{"prompt": "Say hi.", "completion": " hi"}] * 3)

    monkeypatch.setattr(datasets, "load_dataset", fake_hub)
    examples = load_examples(HubDataset("someone/chat"), tok)
    assert asked == [("someone/chat", "train")] and len(examples) == 3
    assert all(example.trainable for example in examples)
    with pytest.raises(DataError, match=r"--data 'nobody/none': no such local file.*ConnectionError"):
        load_examples(HubDataset("nobody/none"), tok)
