"""Settings that waste devices are named once with the better value, and the plan table's title
stays on one line at 80 columns."""

from __future__ import annotations

import pytest

from roundpipe.cli import main
from roundpipe.settings_advice import microbatch_advice


def test_microbatches_not_a_multiple_of_the_devices() -> None:
    advice = microbatch_advice(3, 2, 16, ms_per_microbatch=lambda m: 76.0 if m == 3 else 60.0)
    assert advice is not None
    assert advice.startswith("--microbatches 3 wastes device time")
    assert "--microbatches 4 of 4 rows each keeps both devices busy, about 21% less time" in advice
    assert microbatch_advice(4, 2, 16) is None  # the default: nothing to say
    assert microbatch_advice(3, 1, 16) is None  # one device: nothing to keep busy
    # where the planner's simulation shows no gain, nothing is said
    assert microbatch_advice(6, 4, 24, ms_per_microbatch=lambda m: 40.8) is None
    # an uneven split of the batch, on a multiple of the devices
    assert "18 rows do not split evenly into 4" in (microbatch_advice(4, 2, 18) or "")


def test_plan_and_simulate_say_it_once(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--example", "tiny", "-n", "2", "-m", "3"]) == 0
    err = capsys.readouterr().err
    assert err.count("note: --microbatches 3 wastes device time") == 1
    assert "--microbatches 4 keeps both devices busy" in err
    assert main(["simulate", "--example", "tiny", "-n", "2", "-m", "4", "--json"]) == 0
    assert "wastes" not in capsys.readouterr().err


def test_plan_title_is_one_line_at_80_columns(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    assert main(["plan", "--example", "llama-8b", "--devices", "8", "--microbatches", "16"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.strip() == "plan for llama-8b: 34 layers on 8 devices, 16 microbatches"
