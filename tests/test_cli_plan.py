"""The `roundpipe` command line, in-process: plan, simulate, trace, and one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from roundpipe.cli import main
from roundpipe.cli.plan_commands import parse_bytes
from roundpipe.plan.costs import LayerCosts
from roundpipe.sched.trace import Trace


@pytest.fixture
def costs_file(tmp_path: Path) -> Path:
    path = tmp_path / "costs.json"
    LayerCosts.uniform(6, fwd_ms=1.0, bwd_ms=2.0, mem_bytes=1000, head_factor=2.0).to_json(path)
    return path


def _no_traceback(err: str) -> None:
    assert "Traceback" not in err


def test_plan_table(costs_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--costs", str(costs_file), "--devices", "2", "--microbatches", "4"]) == 0
    out = capsys.readouterr().out
    for word in (
        "slot",
        "kind",
        "layers",
        "ms / microbatch",
        "FB",
        "fused",
        "t_max",
        "analytic bubble",
        "objective",
        "iteration",
        "planned in",
    ):
        assert word in out


@pytest.mark.parametrize("loss_lag", [0, 1])
def test_plan_shows_the_iteration_that_chose_it(capsys: pytest.CaptureFixture[str], loss_lag: int) -> None:
    """The plan is `choose_evaluated_plan`'s for the loop asked for, and its figure the evaluator's:
    on the built-in example one loss late runs a plan of its own (5 slots; waiting, 10)."""
    from roundpipe.plan.examples import EXAMPLES
    from roundpipe.planning.ranking import (
        choose_evaluated_plan,
        engine_evaluator,
        late_loop_evaluator,
        submission_lag,
    )

    assert main(["plan", "--loss-lag", str(loss_lag), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    costs = EXAMPLES["qwen3-1.7b"].costs()
    plan = choose_evaluated_plan(costs, 8, 16, None, async_optimizer=True, loss_lag=loss_lag)
    assert [s["layers"] for s in info["slots"]] == [[s.layers.start, s.layers.stop] for s in plan.slots]
    evaluate = (
        late_loop_evaluator(costs, 8, 16)
        if loss_lag
        else engine_evaluator(costs, 8, 16, async_optimizer=True)
    )
    assert info["iteration_ms"] == pytest.approx(evaluate(plan))
    assert info["loss_lag"] == loss_lag and info["planning_ms"] > 0
    assert info["submission_lag"] == submission_lag(
        plan, costs, 8, 16, async_optimizer=True, loss_lag=loss_lag
    )
    assert info["num_slots"] == (5 if loss_lag else 10)


def test_plan_json(costs_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "plan",
        "--costs",
        str(costs_file),
        "-n",
        "2",
        "-m",
        "4",
        "--sync",
        "--mem-limit",
        "1MB",
        "--json",
    ]
    assert main(argv) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["num_devices"] == 2 and info["num_microbatches"] == 4
    assert info["async_optimizer"] is False
    assert info["mem_limit_bytes"] == 10**6
    assert info["num_slots"] == len(info["slots"])
    covered = sorted(layer for s in info["slots"] if s["kind"] != "fwd" for layer in range(*s["layers"]))
    assert covered == list(range(6))  # fused + backward stages cover every layer once
    assert info["t_max_ms"] == pytest.approx(max(s["ms"] for s in info["slots"]))
    assert 0 <= info["analytic_bubble"] < 1


def test_simulate_default_example(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate"]) == 0
    out = capsys.readouterr().out
    assert "qwen3-1.7b" in out
    assert "bubble ratio" in out and "%" in out
    assert "steady-state bubble" in out  # async, 4 iterations
    assert "utilisation" in out and "d7" in out


def test_simulate_writes_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    trace, perfetto, png = tmp_path / "t.json", tmp_path / "t.perfetto.json", tmp_path / "t.png"
    argv = ["simulate", "--example", "tiny", "-n", "2", "-m", "4", "-k", "2", "--link-gbps", "10"]
    argv += ["--trace", str(trace), "--perfetto", str(perfetto), "--png", str(png), "--json"]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert 0 <= result["bubble_ratio"] < 1
    assert result["steady_bubble_ratio"] is None  # fewer than 3 iterations
    assert set(result["files"]) == {"trace", "perfetto", "png"}
    assert len(Trace.load(trace)) == result["tasks"]
    assert "traceEvents" in json.loads(perfetto.read_text())
    assert png.read_bytes()[:4] == b"\x89PNG"


@pytest.fixture
def good_trace(tmp_path: Path) -> Path:
    path = tmp_path / "good.json"
    argv = ["simulate", "--example", "tiny", "-n", "2", "-m", "4", "-k", "2", "--sync", "--trace", str(path)]
    assert main([*argv, "--json"]) == 0
    return path


def test_trace_check_summary_replay(good_trace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    assert main(["trace", "check", str(good_trace)]) == 0
    assert capsys.readouterr().out.startswith("ok:")
    assert main(["trace", "summary", str(good_trace)]) == 0
    assert "bubble" in capsys.readouterr().out
    assert main(["trace", "replay", str(good_trace)]) == 0
    assert "identical" in capsys.readouterr().out
    assert main(["trace", "grid", str(good_trace), "--width", "40"]) == 0
    assert "d0.compute" in capsys.readouterr().out
    out = good_trace.with_name("conv.perfetto.json")
    assert main(["trace", "perfetto", str(good_trace), "-o", str(out)]) == 0
    assert json.loads(out.read_text())["displayTimeUnit"] == "ms"


def test_trace_check_tampered(good_trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = Trace.load(good_trace)
    by_key = {t.key: t for t in trace.records}
    victim = next(t for t in trace.records if t.kind == "compute" and t.iteration == 1 and t.deps)
    dep = max((by_key[k] for k in victim.deps if k in by_key), key=lambda t: t.end_t)
    victim.start_t = dep.end_t - 0.5 * (dep.end_t - dep.start_t) - 1e-3  # before its dependency ended
    bad = trace.save(tmp_path / "bad.json")
    capsys.readouterr()
    assert main(["trace", "check", str(bad)]) == 1
    captured = capsys.readouterr()
    assert "dependency broken" in captured.out
    assert "d0.compute |" in captured.out or "d1.compute |" in captured.out  # the grid
    assert f"! {victim.describe()}" in captured.out
    assert "dependency broken" in captured.err
    _no_traceback(captured.err)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["plan", "--costs", "{missing}"], "No such file"),
        (["plan", "--costs", "{badjson}"], "not valid JSON"),
        (["plan", "--costs", "{negative}"], "fwd_ms[1]"),
        (["simulate", "--devices", "0"], "must be >= 1"),
        (["simulate", "--example", "gpt-17"], "invalid choice"),
        (["plan", "--mem-limit", "lots"], "not a size"),
        (["plan", "--example", "tiny", "--mem-limit", "1KB"], "mem_limit_bytes"),
        (["trace", "check", "{badjson}"], "not valid JSON"),
        (["trace", "summary", "{costs}"], "not a roundpipe trace"),
        (["trace", "check", "{missing}"], "No such file"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    argv: list[str], message: str, tmp_path: Path, costs_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "negative.json").write_text(
        json.dumps({"fwd_ms": [1, -1], "bwd_ms": [2, 2], "mem_bytes": [0, 0]})
    )
    files = {
        "missing": str(tmp_path / "nope.json"),
        "badjson": str(tmp_path / "bad.json"),
        "negative": str(tmp_path / "negative.json"),
        "costs": str(costs_file),
    }
    argv = [a.format(**files) for a in argv]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("roundpipe: error: ")
    assert message in captured.err.splitlines()[0]
    _no_traceback(captured.err)


def test_help_and_no_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for command in ("plan", "simulate", "trace"):
        assert command in out
    assert main([]) == 2


def test_parse_bytes() -> None:
    assert parse_bytes("24GB") == 24 * 10**9
    assert parse_bytes("24GiB") == 24 * 2**30
    assert parse_bytes("1.5e9") == 1_500_000_000
    assert parse_bytes("512 MiB") == 512 * 2**20


def test_the_shipped_costs_file_plans_as_the_docs_say(capsys: pytest.CaptureFixture[str]) -> None:
    costs = Path(__file__).resolve().parent.parent / "examples" / "costs.json"
    assert main(["plan", "--costs", str(costs), "--devices", "4", "--microbatches", "16", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["num_layers"] == len(LayerCosts.from_json(costs).fwd_ms)


def test_simulate_shows_the_cost_of_fresh_layers(
    costs_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["simulate", "--costs", str(costs_file), "--devices", "2", "--microbatches", "4", "--json"]
    assert main([*argv, "--optimizer-ms", "0.5"]) == 0
    stale = json.loads(capsys.readouterr().out)
    assert main([*argv, "--optimizer-ms", "0.5", "--fresh-layers", "2"]) == 0
    fresh = json.loads(capsys.readouterr().out)
    assert (stale["fresh_layers"], fresh["fresh_layers"], fresh["optimizer_ms"]) == (0, 2, 0.5)
    assert fresh["makespan_ms"] >= stale["makespan_ms"]
    assert main([*argv, "--optimizer-ms", "0.5", "--after-loss"]) == 0
    loop = json.loads(capsys.readouterr().out)
    assert loop["after_loss"] and loop["makespan_ms"] >= stale["makespan_ms"] * 0.999
    assert main([*argv, "--sync", "--fresh-layers", "2"]) == 2
    assert "asynchronous remedies" in capsys.readouterr().err


def test_simulate_shows_that_a_fresh_first_layer_makes_the_next_forward_wait(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The built-in example's split plan: its first layer's step comes after the last backward
    stage, and its next forward is the first one; fresh, the next iteration waits (a drain)."""
    argv = ["simulate", "--iterations", "4", "--after-loss", "--json"]
    assert main(argv) == 0
    stale = json.loads(capsys.readouterr().out)
    assert main([*argv, "--fresh-at", "1"]) == 0
    fresh = json.loads(capsys.readouterr().out)
    assert (stale["fresh_at"], fresh["fresh_at"]) == ([], [1])
    assert fresh["makespan_ms"] > 1.05 * stale["makespan_ms"]
    assert main([*argv, "--fresh-at", "99"]) == 2
    assert "--fresh-at 99 but the model has" in capsys.readouterr().err


def test_simulate_reads_losses_late_when_asked(capsys: pytest.CaptureFixture[str]) -> None:
    """The built-in example as a loop reading each loss one iteration late: no longer than the
    waiting loop, and the option makes sense only with --after-loss."""
    argv = ["simulate", "--iterations", "12", "--after-loss", "--json"]
    runs = []
    for lag in ("0", "1"):
        assert main([*argv, "--loss-lag", lag]) == 0
        runs.append(json.loads(capsys.readouterr().out))
    assert [r["loss_lag"] for r in runs] == [0, 1]
    assert runs[1]["makespan_ms"] <= runs[0]["makespan_ms"]
    assert main(["simulate", "--loss-lag", "1"]) == 2
    assert "add --after-loss" in capsys.readouterr().err
