"""bench/gpu_throughput.py on CPU workers: every path it takes on a GPU except the CUDA calls.

The GPU run gets little device time, so the script's command line, both sides, the plain loop's
own process, the JSON lines, the budget's route into RunConfig and the "cannot hold" verdict are
all exercised here with ``--devices cpu:2`` and the tiny shape.
"""

from __future__ import annotations

import contextlib
import gzip
import importlib.util
import io
import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch

from roundpipe.sched.trace import Trace

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_throughput.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_throughput", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_throughput"] = module
    spec.loader.exec_module(module)
    return module


bench = _load()
pieces = sys.modules["gpu_throughput_run"]
torch_profile = sys.modules["torch_profile"]


def _json_lines(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def test_smoke_run_gives_both_modes_both_sides_and_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """In this process (one interpreter start saved); the plain loop runs the script as a program."""
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    out = tmp_path / "runs.jsonl"
    argv = ["--devices", "cpu:2", "--workload", "tiny", "--seq", "16", "--steps", "1", "--warmup", "1"]
    bench.main([*argv, "--out", str(out), "--save-trace", str(tmp_path / "traces")])
    captured = capsys.readouterr()
    stdout = captured.out
    lines = _json_lines(stdout)
    assert [(line["workload"], line["mode"]) for line in lines] == [("tiny", "sync"), ("tiny", "async")]
    # Progress on stderr as each run goes: a run killed at its limit still shows where it was.
    for expected in ("tiny: model built in", "tiny sync: pipe open, ", "tiny async: pipe open, "):
        assert expected in captured.err, captured.err
    steps = [line for line in captured.err.splitlines() if "tiny async: step" in line]
    assert len(steps) == 2 and "1/2" in steps[0] and "(warm-up)" in steps[0]  # --warmup 1 --steps 1
    assert "2/2" in steps[1] and "(warm-up)" not in steps[1]
    assert _json_lines(out.read_text()) == lines
    for line in lines:
        ours, plain = line["roundpipe"], line["plain"]
        assert "error" not in ours, ours
        assert ours["tokens_per_s"] > 0 and ours["slots"] >= 1
        assert 0.0 <= ours["exposed_transfer"] <= ours["bubble"] <= 1.0
        assert ours["breakdown"]["iterations"] == [1]
        window_s = ours["breakdown"]["window_ms"] / 1000  # one measured iteration of 64 tokens
        assert ours["tokens_per_s_trace"] == pytest.approx(64 / window_s, rel=1e-3)
        assert ours["pinned_host_growth"] == {
            "new_blocks": 0.0,
            "alloc_ms": 0.0,
            "allocated_gib": 0.0,
        }  # no CUDA
        assert ours["busy_ms_per_step"]["compute"] > 0
        assert ours["peak_gib"] == {} and ours["host_rss_gib"]["peak"] > 0
        assert ours["optimizer"] and ours["predicted_peak_gib"] is None
        assert plain["device"] == "cpu" and plain["tokens_per_s"] > 0, plain
        assert line["ratio"] == pytest.approx(ours["tokens_per_s"] / plain["tokens_per_s"], rel=1e-2)
        assert line["tokens_per_step"] == 4 * 16 and line["budget_field"] is None
        assert ours["model_dtype"] == "float32" and ours["build_s"] >= 0 and ours["elapsed_s"] > 0
        assert ours["host_bound"] == 0.0  # CPU workers complete on return: nothing issued ahead
        assert ours["compile_s_measured"] == 0.0  # nothing compiles on CPU by default
        host = line["host"]  # the host's CPU and issue speed, measured once for the process
        assert host == lines[0]["host"] and host["cpus"] >= 1
        assert host["python_loop_ms"] > 0 and host["torch_op_us"] > 0
        saved_path = tmp_path / "traces" / f"tiny-{line['mode']}.trace.json.gz"
        with gzip.open(saved_path, "rt") as fh:
            json.load(fh)  # gzipped JSON
        assert {t.kind for t in Trace.load(saved_path)} >= {"compute", "param_up"}
    # The model is built once: sync trains a copy, async the original, from the same weights.
    assert lines[0]["roundpipe"]["loss_first_last"][0] == lines[1]["roundpipe"]["loss_first_last"][0]
    assert "ours tok/s" in stdout  # the table at the end


def _plain_child_in_this_process(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """The plain loop's command, run through the script's own ``--plain-child`` entry in this
    process (the smoke test above starts it as a real process: this saves an interpreter start,
    seconds of imports). Returns the commands it ran."""
    commands: list[list[str]] = []

    def run(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        assert cmd[:3] == [sys.executable, str(SCRIPT), "--plain-child"], cmd
        assert kwargs["stdout"] == subprocess.PIPE and kwargs["text"], kwargs
        commands.append(cmd)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            bench.main(cmd[2:])
        return subprocess.CompletedProcess(cmd, 0, out.getvalue())

    monkeypatch.setattr(bench, "subprocess", SimpleNamespace(run=run, PIPE=subprocess.PIPE))
    return commands


def test_torch_profile_sees_the_lane_threads_operators(capsys: pytest.CaptureFixture[str]) -> None:
    """The layers run on roundpipe's lane threads, not the caller's: the profile must see them."""
    argv = ["--devices", "cpu:1", "--workload", "tiny", "--seq", "16", "--steps", "2", "--warmup", "1"]
    bench.main([*argv, "--async", "--no-plain", "--torch-profile"])
    (line,) = _json_lines(capsys.readouterr().out)
    summary = line["roundpipe"]["torch_profile"]
    assert summary["steps"] == 2 and summary["ranked_by"] == "self host time"
    names = {row["name"] for row in summary["top"]}
    assert "aten::mm" in names, names  # the layers' products, issued from the compute lane
    mm = next(row for row in summary["top"] if row["name"] == "aten::mm")
    assert mm["calls_per_step"] > 0 and summary["host_ms_per_step"] >= mm["self_host_ms_per_step"] > 0


def test_device_time_is_summed_by_kernel_kind_without_the_operators() -> None:
    """Kernels and copies are summed by kind (names an H100 profile of D16 gave), a grouped
    product is not counted as a plain one, and host operators, whose device time repeats their
    kernels', are left out of the sums and of the kernels' own ranking."""
    from torch.autograd import DeviceType

    def row(name: str, device_ms: float, count: int, device: DeviceType) -> SimpleNamespace:
        return SimpleNamespace(
            key=name,
            self_device_time_total=device_ms * 1000,
            self_cpu_time_total=0.0,
            count=count,
            device_type=device,
        )

    cuda = DeviceType.CUDA
    rows = [
        row(
            "_ZN7cutlass13device_kernelIN2at4cuda6detail25enable_3x_kernel_for_sm9xINS_4gemm6kernel13GemmUniversalINS5_17GroupProblem",
            40.0,
            128,
            cuda,
        ),
        row("nvjet_sm90_tst_320x128_64x3_2x1_v_bz_coopB_TNT", 50.0, 64, cuda),
        row("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26", 44.0, 64, cuda),
        row("triton_per_fused_index_sum_view_2", 10.0, 64, cuda),
        row("triton_red_fused__to_copy_arange_eq_exp_logsumexp_mul_sub_unsqueeze_0", 42.0, 80, cuda),
        row("Memcpy HtoD (Pinned -> Device)", 122.0, 169, cuda),
        row("void at::native::vectorized_elementwise_kernel", 3.0, 30, cuda),
        row("aten::_grouped_mm", 83.0, 256, DeviceType.CPU),
    ]
    kinds = torch_profile.kernels_by_kind(rows, per_step=2)
    assert list(kinds) == ["copy", "triton", "product", "attention", "grouped_product", "other"]
    assert kinds["triton"] == {"ms_per_step": 26.0, "calls_per_step": 72.0}
    assert kinds["grouped_product"] == {"ms_per_step": 20.0, "calls_per_step": 64.0}
    assert kinds["other"]["ms_per_step"] == 1.5
    summary = torch_profile.summarize(rows, steps=2, on_device=True)
    assert summary["device_ms_per_step"] == 155.5  # the operator's 83 ms not counted twice
    assert [r["name"] for r in summary["top_kernels"]][:2] == [rows[5].key, rows[1].key]
    assert "aten::_grouped_mm" not in {r["name"] for r in summary["top_kernels"]}


def test_a_profiled_run_reports_each_layers_times_as_profiled_and_as_planned(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Under a budget the layers are measured on the device (here the CPU): the line carries each
    layer's profiled times and the times the plan used, one per layer, every one positive."""
    argv = ["--devices", "cpu:1", "--workload", "tiny", "--seq", "16", "--steps", "1", "--warmup", "1"]
    bench.main([*argv, "--async", "--no-plain", "--budget", "1GiB"])
    (line,) = _json_lines(capsys.readouterr().out)
    layer_ms = line["roundpipe"]["layer_ms"]
    assert set(layer_ms) == {"profiled_fwd", "profiled_bwd", "fwd", "bwd"}
    layers = bench.WORKLOADS["tiny"].shape.layers + 2  # the embedding and the head are layers too
    assert all(len(ms) == layers and min(ms) > 0 for ms in layer_ms.values()), layer_ms
    assert bench.layer_ms({"layer_costs": {"fwd_ms": [1.0]}}) is None  # nothing profiled: no table
    slowest = line["roundpipe"]["slowest_computes"]
    assert slowest and [s["ms"] for s in slowest] == sorted((s["ms"] for s in slowest), reverse=True)
    assert {s["kind"] for s in slowest} <= {"compute", "recompute"} and slowest[0]["layers"][1] > 0


def test_lora_under_a_tiny_budget_reports_both_verdicts(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A --budget caps roundpipe's plan, not the plain loop (the whole model on the card as it is);
    a budget that is part of a workload's definition (C) caps both. The roundpipe side's failure
    is its line, not a crash."""
    commands = _plain_child_in_this_process(monkeypatch)
    argv = ["--devices", "cpu:2", "--workload", "tiny", "--lora-r", "4", "--budget", "100KiB", "--sync"]
    bench.main([*argv, "--steps", "1", "--warmup", "1"])  # as the smoke test: 2 steps, not 7
    (line,) = _json_lines(capsys.readouterr().out)
    assert isinstance(line["plain"], dict) and line["plain"]["tokens_per_s"] > 0
    (command,) = commands  # the plain loop ran once, on the LoRA model, without the --budget
    assert json.loads(command[3])["workload"]["lora_r"] == 4
    assert json.loads(command[3])["workload"]["budget"] is None
    assert bench.plain_cannot_hold(bench.WORKLOADS["C"]) == "cannot hold the base in 24GiB"
    assert line["lora_r"] == 4 and line["budget"] == "100KiB" and line["ratio"] is None
    assert line["budget_field"] in ("memory_budget", "mem_limit_bytes")
    assert "tokens_per_s" in line["roundpipe"] or "error" in line["roundpipe"]


def test_choice_sum_flag_forces_the_kernels_either_way_or_leaves_the_default() -> None:
    from roundpipe.model import choice_sum

    assert bench.parse_args(["--workload", "D"]).choice_sum == "auto"
    for flag, inside in (("auto", None), ("on", True), ("off", False)):
        args = bench.parse_args(["--workload", "D", "--choice-sum", flag])
        with bench.choice_sum_kernels(args.choice_sum):
            assert choice_sum.ENABLED is inside, flag
        assert choice_sum.ENABLED is None
    with pytest.raises(SystemExit):
        bench.parse_args(["--choice-sum", "yes"])


def test_save_residuals_flag_reaches_the_run_config_or_leaves_its_default() -> None:
    for argv, saved in (
        ([], True),
        (["--save-residuals", "false"], False),
        (["--save-residuals", "true"], True),
    ):
        args = bench.parse_args(["--workload", "E", *argv])
        assert bench.make_config(args.workloads[0], "async", args).save_residuals is saved, argv


def test_dequantize_flag_reaches_the_run_config_or_leaves_its_default() -> None:
    for argv, dequantize in (
        ([], "auto"),
        (["--dequantize", "run"], "run"),
        (["--dequantize", "call"], "call"),
    ):
        args = bench.parse_args(["--workload", "E-nf4", *argv])
        assert bench.make_config(args.workloads[0], "async", args).dequantize == dequantize, argv


def test_lora_roundpipe_side_trains_adapters_in_bf16() -> None:
    args = bench.parse_args(["--devices", "cpu:2", "--workload", "tiny", "--lora-r", "4"])
    args.steps, args.warmup = 1, 1
    model = pieces.build_model(args.workloads[0], torch.bfloat16)
    result = bench.run_roundpipe(args.workloads[0], "async", args, model)
    assert result["tokens_per_s"] > 0 and result["model_dtype"] == "bfloat16"
    assert result["breakdown"]["iterations"] == [1]


def test_workloads_flags_and_overrides() -> None:
    args = bench.parse_args(["--workload", "A,B", "--workload", "long", "--workload", "A", "--async"])
    assert [w.name for w in args.workloads] == ["A", "B", "long"] and args.modes == ["async"]
    a, b, long = args.workloads
    assert (a.batch, a.seq, a.microbatches, a.shape.layers, a.shape.tied) == (8, 4096, 8, 28, True)
    assert (b.batch, b.seq, b.microbatches) == (32, 2048, 4)
    assert (long.seq, long.budget, long.recompute_grain) == (131072, "24GiB", "layer")
    c = bench.WORKLOADS["C"]
    assert (c.shape.hidden, c.shape.intermediate, c.shape.heads, c.shape.tied, c.lora_r) == (
        5120,
        17408,
        40,
        False,
        16,
    )
    custom = bench.parse_args(
        ["--workload", "C", "--layers", "2", "--no-tied", "--budget", "none", "--seq", "64"]
    )
    (w,) = custom.workloads
    assert (w.shape.layers, w.shape.tied, w.budget, w.seq, w.lora_r) == (2, False, None, 64, 16)
    assert custom.modes == ["sync", "async"] and custom.devices == "cuda"
    with pytest.raises(SystemExit):
        bench.parse_args(["--workload", "Z"])
    with pytest.raises(ValueError, match="not understood"):
        bench.parse_args(["--budget", "lots"])


def test_compile_seconds_count_a_compile_and_its_backward() -> None:
    import torch._dynamo

    before = bench.compile_seconds()
    x = torch.ones(3, requires_grad=True)
    compiled = torch.compile(lambda t: (t * 2).sum(), backend="aot_eager")
    compiled(x)
    after_forward = bench.compile_seconds()
    compiled(x).backward()  # the backward is built at its first call
    after_backward = bench.compile_seconds()
    torch._dynamo.reset()
    assert before < after_forward < after_backward


def test_parse_size() -> None:
    assert bench.parse_size("24GiB") == 24 << 30
    assert bench.parse_size("1.5 GB") == 1_500_000_000
    assert bench.parse_size("512mib") == 512 << 20
    assert bench.parse_size("4096") == 4096
    with pytest.raises(ValueError, match="24GiB"):
        bench.parse_size("24 parsecs")


@pytest.mark.parametrize("tied", [True, False])
def test_param_counts_match_the_built_model(tied: bool) -> None:
    workload = bench.Workload("t", bench.replace(bench.TINY, tied=tied), 1, 8, 1, lora_r=2)
    model = pieces.build_model(bench.replace(workload, lora_r=0), torch.float32)
    assert sum(p.numel() for p in model.parameters()) == workload.shape.param_count()
    lora = pieces.build_model(workload, torch.float32)
    assert sum(p.numel() for p in lora.parameters() if p.requires_grad) == workload.lora_param_count()


def test_plain_verdict_for_the_14b_shape() -> None:
    c = bench.WORKLOADS["C"]
    assert 14.0e9 < c.shape.param_count() < 15.5e9
    assert bench.plain_cannot_hold(c) == "cannot hold the base in 24GiB"
    assert bench.plain_cannot_hold(bench.replace(c, budget="64GiB")) is None
    assert bench.plain_cannot_hold(bench.replace(c, budget=None)) is None
    # 3.4 GB of weights fit, but not transformers' logits of 131,072 tokens (bf16 and fp32: 119 GB).
    assert bench.plain_cannot_hold(bench.WORKLOADS["long"]) == "cannot hold the logits in 24GiB"


def test_model_dtype_and_cuda_indices() -> None:
    assert pieces.model_dtype("auto", True) == torch.bfloat16
    assert pieces.model_dtype("auto", False) == torch.float32
    assert pieces.model_dtype("bf16", False) == torch.bfloat16
    assert pieces.cuda_indices("cpu:2") == ()


def test_predicted_memory_is_read_where_the_pipe_has_it() -> None:
    assert pieces.predicted_memory(SimpleNamespace(plan=None)) == {
        "predicted_memory": None,
        "predicted_peak_gib": None,
    }
    assert pieces.predicted_memory(SimpleNamespace(plan_memory=3 << 30))["predicted_peak_gib"] == 3.0
    method = SimpleNamespace(memory_prediction=lambda: {"peak_bytes": 1 << 29, "stages": [1, 2]})
    assert pieces.predicted_memory(method) == {
        "predicted_memory": {"peak_bytes": 1 << 29, "stages": [1, 2]},
        "predicted_peak_gib": 0.5,
    }
    on_plan = SimpleNamespace(plan=SimpleNamespace(memory_prediction=SimpleNamespace(total_bytes=1 << 30)))
    assert pieces.predicted_memory(on_plan)["predicted_peak_gib"] == 1.0


def test_rss_sampler_sees_this_process() -> None:
    with pieces.RssSampler(interval_s=0.01) as rss:
        pass
    report = rss.report()
    assert report["peak"] >= report["end"] > 0


def test_table_shows_errors_and_verdicts() -> None:
    line = {
        "workload": "C",
        "mode": "async",
        "roundpipe": {"error": "out of memory", "peak_gib": {"cuda:0": 23.5}},
        "plain": "cannot hold the base in 24GiB",
        "ratio": None,
    }
    text = bench.table([line])
    assert "error" in text and "cannot hold the base in 24GiB" in text and "23.5" in text
    ours = {"tokens_per_s": 29453.8, "peak_gib": {"cuda:0": 3.13}, "bubble": 0.023, "exposed_transfer": 0.003}
    measured = {**line, "workload": "A", "roundpipe": {**ours, "host_bound": 0.1636}, "plain": None}
    assert "host-bound" in text and text.splitlines()[1].split()[-1] == "-"
    assert bench.table([measured]).splitlines()[1].split()[-4:] == ["-", "2.3%", "0.3%", "16.4%"]


def test_cuda_probes_ask_each_device(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, int]] = []
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda i: calls.append(("reset", i)))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda i: calls.append(("sync", i)))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda i: (i + 1) << 30)
    pieces.reset_peaks((0, 1))
    pieces.sync_devices((0, 1))
    # A device is initialised (synchronized) before its peak is reset: resetting an unused one fails.
    assert calls == [("sync", 0), ("reset", 0), ("sync", 1), ("reset", 1), ("sync", 0), ("sync", 1)]
    assert pieces.device_memory((0, 1)) == {"cuda:0": 1.0, "cuda:1": 2.0}


def test_from_config_takes_whichever_dtype_keyword_the_release_knows() -> None:
    seen: list[str] = []

    class OlderAuto:
        @staticmethod
        def from_config(config: object, attn_implementation: str, **kwargs: Any) -> torch.nn.Module:
            seen.append(next(iter(kwargs)))
            if "dtype" in kwargs:
                raise TypeError("__init__() got an unexpected keyword argument 'dtype'")
            return torch.nn.Linear(2, 2)  # ignores torch_dtype: built in fp32

    model = pieces._from_config(OlderAuto, object(), torch.bfloat16)
    assert seen == ["dtype", "torch_dtype"]
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


@pytest.mark.parametrize("field_type", [str, int])
def test_budget_reaches_memory_budget_where_run_config_has_it(
    monkeypatch: pytest.MonkeyPatch, field_type: type
) -> None:
    import roundpipe

    class BudgetConfig(roundpipe.RunConfig):
        memory_budget: field_type | None = None  # type: ignore[valid-type]

    monkeypatch.setattr(roundpipe, "RunConfig", BudgetConfig)
    args = bench.parse_args(["--devices", "cpu:2", "--workload", "C"])
    (workload,) = args.workloads
    assert bench.budget_route(workload) == {"budget_field": "memory_budget"}
    config = bench.make_config(workload, "async", args)
    assert config.memory_budget == ("24GiB" if field_type is str else 24 << 30)
    assert config.mem_limit_bytes is None and config.recompute_grain == "auto"


@pytest.mark.parametrize("flag,setting", [(None, "auto"), ("false", False), ("true", True), ("auto", "auto")])
def test_compile_flag_reaches_run_config(flag: str | None, setting: object) -> None:
    argv = ["--devices", "cpu:2", "--workload", "D", *(["--compile", flag] if flag else [])]
    args = bench.parse_args(argv)
    (workload,) = args.workloads
    assert bench.make_config(workload, "async", args).compile == setting


def test_planner_settings_hold_for_the_run_only(capsys: pytest.CaptureFixture[str]) -> None:
    """--one-device-stages and --flow-depth plan the run so (the graph runs the depth the plan
    counted), --upload-parts-ahead reaches its graph, and the process-wide choices are set back
    afterwards."""
    from roundpipe import assembly
    from roundpipe.planning import device_plan

    argv = ["--devices", "cpu:1", "--workload", "tiny", "--seq", "16", "--steps", "1", "--warmup", "1"]
    planner = [
        "--one-device-stages",
        "balanced",
        "--flow-depth",
        "4",
        "--microbatches",
        "4",
        "--upload-parts-ahead",
        "3",
    ]
    bench.main([*argv, "--async", "--no-plain", "--budget", "4MiB", *planner, "--backward-stage-layers", "1"])
    (line,) = _json_lines(capsys.readouterr().out)
    assert line["roundpipe"]["one_device_stages"] == "balanced" and line["roundpipe"]["tokens_per_s"] > 0
    assert line["roundpipe"]["flow_depth"] == 4 and line["roundpipe"]["backward_stage_layers"] == 1
    assert (device_plan.STAGES_ON_ONE_DEVICE, device_plan.FLOW_DEPTH) == ("coarse", 2)
    assert device_plan.BACKWARD_STAGE_LAYERS is None
    assert line["roundpipe"]["upload_parts_ahead"] == 3 and assembly.UPLOAD_PARTS_AHEAD is None
    assert all(ms >= 0 for ms in line["roundpipe"]["gap_causes_ms"].values())


def test_under_torchrun_the_plain_loop_is_left_to_a_one_process_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """Data parallel (`torchrun ... bench/gpu_throughput.py`): the rank and the process count come
    from torchrun's variables, and the plain loop, one process, is not run beside the processes
    (checked by hand end to end: `torchrun --standalone --nproc-per-node 2 bench/gpu_throughput.py
    --workload tiny --devices cpu:1 --steps 2 --warmup 1 --async` prints rank 0's line alone,
    "processes": 2 and the global batch)."""
    assert bench.processes() == (0, 1)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert bench.processes() == (1, 2)
    args = bench.parse_args(["--devices", "cpu:1", "--workload", "tiny"])
    plain = bench.plain_in_subprocess(args.workloads[0], args)
    assert isinstance(plain, str) and "not run under torchrun" in plain
    line = bench._line(args.workloads[0], "async", args, {"tokens_per_s": 1.0}, plain)
    assert line["processes"] == 2 and line["tokens_per_step"] == 2 * args.workloads[0].tokens


# --------------------------------------------------------------------- big models, long context

TINY_FLAGS = "--layers 2 --hidden 64 --heads 4 --kv-heads 2 --head-dim 16 --vocab 256".split()
TINY_FLAGS += "--batch 2 --seq 32 --microbatches 2 --budget none --no-plain".split()


@pytest.mark.parametrize(
    ("name", "billions", "family"),
    [
        ("E", 32.8, "qwen3"),
        ("E-nf4", 32.8, "qwen3"),
        ("F", 70.6, "llama"),
        ("G", 8.03, "llama"),
        ("G-nf4", 8.03, "llama"),
        ("D", 30.5, "qwen3_moe"),
        ("D16", 30.5, "qwen3_moe"),
        ("D2", 20.9, "gpt_oss"),
    ],
)
def test_big_workloads_have_the_named_shapes(name: str, billions: float, family: str) -> None:
    workload = bench.WORKLOADS[name]
    assert workload.shape.family == family and workload.layerwise and workload.lora_r == 16
    assert workload.budget == "24GiB" and not workload.shape.tied
    assert workload.shape.param_count() / 1e9 == pytest.approx(billions, rel=0.01)
    assert bench.plain_cannot_hold(workload) in (
        "cannot hold the base in 24GiB",
        "cannot hold the logits in 24GiB",
    )
    assert workload.base_format == ("nf4" if name in ("E-nf4", "F", "G-nf4") else "bf16")
    assert workload.tokens == {"G": 262144, "G-nf4": 262144, "D16": 16 * 4096}.get(name, 4 * 4096)


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_moe", "gpt_oss"])
def test_layerwise_build_gives_the_model_on_the_host(family: str) -> None:
    args = bench.parse_args(
        ["--workload", "D2", "--family", family, "--experts", "4", "--experts-per-token", "2"]
    )
    workload = bench.replace(
        args.workloads[0],
        shape=bench.replace(
            args.workloads[0].shape,
            layers=2,
            hidden=64,
            intermediate=32,
            heads=4,
            kv_heads=2,
            head_dim=16,
            vocab=256,
        ),
        seq=32,
        lora_r=4,
    )
    model = pieces.build_model(workload, torch.float32, init_on_gpu=True)
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    assert all(t.device.type == "cpu" and not t.is_meta for t in tensors.values())
    assert sum(p.numel() for p in model.parameters() if not p.requires_grad) == workload.shape.param_count()
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == workload.lora_param_count()
    assert all(float(p.abs().sum()) == 0 for n, p in tensors.items() if "lora_B" in n)
    norms = [p for n, p in tensors.items() if n.endswith("layernorm.weight")]
    assert norms and all(bool((p == 1).all()) for p in norms)
    weights = model.get_base_model().model.layers[1].self_attn.q_proj.base_layer.weight
    assert 0.015 < float(weights.float().std()) < 0.025
    again = pieces.build_model(workload, torch.float32, init_on_gpu=True)  # seeded: the same weights
    assert torch.equal(again.get_base_model().model.layers[1].self_attn.q_proj.base_layer.weight, weights)


@pytest.mark.parametrize(
    ("workload", "extra"),
    [
        ("D", ["--experts", "4", "--experts-per-token", "2", "--intermediate", "32", "--async"]),
        ("D2", ["--experts", "4", "--experts-per-token", "2", "--intermediate", "32", "--async"]),
        ("G", ["--intermediate", "128"]),  # both modes: built again for the second
        # nf4: blocks of 64 weights; the pipe, told base_format="nf4", finds nothing left to quantize
        ("F", ["--hidden", "128", "--head-dim", "32", "--intermediate", "256", "--async"]),
    ],
)
def test_big_workloads_run_end_to_end_at_tiny_shapes(
    workload: str, extra: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    bench.main(
        ["--devices", "cpu:1", "--workload", workload, *TINY_FLAGS, *extra, "--steps", "1", "--warmup", "1"]
    )
    lines = _json_lines(capsys.readouterr().out)
    assert [line["mode"] for line in lines] == (["async"] if "--async" in extra else ["sync", "async"])
    for line in lines:
        ours = line["roundpipe"]
        assert "error" not in ours, ours
        assert (line["layerwise"] and line["plain"] is None) or isinstance(line["plain"], (dict, str))
        assert ours["param_up_bytes_per_iteration"] >= ours["model_upload_bytes"] > 0
        assert 0 < ours["compute_fraction"] <= 1 and 0 < ours["link_busy"] <= 1
        assert ours["h2d_gbps_probe"] is None and "link_bound_tokens_per_s" not in ours  # no GPU
        assert all(loss == loss and 0 < loss < 20 for loss in ours["losses"])  # finite


def test_layerwise_build_quantizes_each_decoder_layer() -> None:
    quant = pytest.importorskip("roundpipe.model.quant")
    if not hasattr(quant, "quantize_frozen_"):
        pytest.skip("roundpipe.model.quant has no quantize_frozen_ in this checkout")
    workload = bench.Workload(
        "q",
        bench.replace(
            bench.LLAMA_8B,
            layers=2,
            hidden=128,
            intermediate=256,
            heads=4,
            kv_heads=2,
            head_dim=32,
            vocab=256,
        ),
        1,
        32,
        1,
        lora_r=4,
        base_format="nf4",
        layerwise=True,
    )
    model = pieces.build_model(workload, torch.bfloat16)
    base = model.get_base_model()
    mlp = base.model.layers[0].mlp
    assert type(mlp.gate_proj).__name__ == "NF4Linear" and type(base.lm_head).__name__ == "Linear"
    frozen = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
    assert frozen < 2 * workload.shape.param_count()  # the decoder layers in 4 bits


def test_link_figures_from_a_trace() -> None:
    """Two iterations of one device: 100 ms windows, uploads of 1 GB busy 40 ms of them
    (overlapping 10 ms), compute 80 ms; a model of 0.5 GB uploaded twice at a 50 GB/s probe."""
    from gpu_link import link_figures

    from roundpipe.sched.task import Task

    def task(kind: str, it: int, start: float, end: float, nbytes: int = 0) -> Task:
        t = Task(("k", kind, it, start), kind, f"d0.{kind}", device=0, iteration=it, nbytes=nbytes)
        t.start_t, t.end_t = start, end
        return t

    tasks = []
    for it in (0, 1):
        base = 100.0 * it
        tasks += [
            task("param_up", it, base, base + 30, 500_000_000),
            task("act_up", it, base + 20, base + 40, 500_000_000),
        ]
        tasks += [
            task("compute", it, base + 10, base + 90),
            task("grad_down", it, base + 90, base + 95, 1000),
        ]
    tasks.append(task("compute", 2, 200, 290))  # outside the measured iterations
    out = link_figures(tasks, [0, 1], (10.0, 190.0), 500_000_000, 50.0, 1000, 5000.0)
    assert out["h2d_bytes_per_iteration"] == 1_000_000_000 and out["d2h_bytes_per_iteration"] == 1000
    assert out["h2d_gbps_achieved"] == 25.0  # 1 GB over the 40 ms some upload moved
    assert out["link_busy"] == pytest.approx((30 + 40) / 180, abs=1e-4)  # clipped to the window
    assert out["compute_fraction"] == pytest.approx(160 / 180, abs=1e-4)
    assert out["param_passes_per_iteration"] == 1.0
    assert out["link_bound_step_s"] == 0.02 and out["link_bound_tokens_per_s"] == 50000.0
    assert out["of_link_bound"] == 0.1


def test_param_up_rates_tell_overlapping_spans_from_stalled_uploads() -> None:
    from gpu_link import param_up_rates

    from roundpipe.sched.task import Task

    def upload(it: int, start: float, end: float) -> Task:
        t = Task(("up", it, start), "param_up", "d0.param_up", device=0, iteration=it, nbytes=1_000_000_000)
        t.start_t, t.end_t = start, end
        return t

    # Iteration 1: two 1 GB uploads whose spans overlap by half; iteration 2: back to back, one
    # of three stalled (the median reads the two others).
    trace = [
        upload(1, 0, 40),
        upload(1, 20, 60),
        upload(2, 100, 120),
        upload(2, 120, 220),
        upload(2, 220, 240),
    ]
    assert param_up_rates(trace) == {"1": [25.0, 25.0, 33.33], "2": [50.0, 21.43, 21.43]}


def test_measured_steps_start_after_the_replan_from_device_measurements() -> None:
    """Under a budget the layers are measured on the device and the one re-plan runs after
    `REPLAN_AFTER_ITERATIONS`; the iteration after it runs the new plan first (compiling its new
    stages on a GPU), so --warmup 1 grows until the plan in force has run once."""
    from roundpipe.planning.measured import REPLAN_AFTER_ITERATIONS

    args = bench.parse_args(["--devices", "cpu:1", "--workload", "tiny", "--budget", "1GiB"])
    args.steps, args.warmup = 1, 1
    model = pieces.build_model(args.workloads[0], torch.float32)
    result = bench.run_roundpipe(args.workloads[0], "async", args, model)
    assert result["warmup_steps"] > REPLAN_AFTER_ITERATIONS - 1  # the re-plan ran in the warm-up
    assert result["breakdown"]["iterations"] == [result["warmup_steps"]]
    no_budget = bench.parse_args(["--devices", "cpu:1", "--workload", "tiny"])
    no_budget.steps, no_budget.warmup = 1, 1
    plain_model = pieces.build_model(no_budget.workloads[0], torch.float32)
    plain = bench.run_roundpipe(no_budget.workloads[0], "async", no_budget, plain_model)
    assert plain["warmup_steps"] == 1  # no plan from device measurements: nothing to wait for


def test_settled_waits_for_the_replan_and_for_one_iteration_of_its_plan() -> None:
    class Planner:
        def __init__(self, device_plan: object, enabled: bool, replanned: bool) -> None:
            self.device_plan, self.replan_enabled, self.replanned = device_plan, enabled, replanned

    class Pipe:
        def __init__(self, planner: Planner | None, plan: str = "new") -> None:
            self._planner, self.plan = planner, plan

    assert bench.replan_pending(Pipe(Planner(object(), True, False)))
    assert not bench.replan_pending(Pipe(Planner(object(), True, True)))
    assert not bench.replan_pending(Pipe(Planner(object(), False, False)))
    assert not bench.replan_pending(Pipe(Planner(None, True, False)))
    assert not bench.replan_pending(Pipe(None))
    done = Planner(object(), True, True)
    assert not bench.settled(Pipe(Planner(object(), True, False)), ["new"])  # re-plan to come
    assert not bench.settled(Pipe(done), ["old", "old"])  # re-planned after the last step
    assert bench.settled(Pipe(done), ["old", "new"])
    assert not bench.settled(Pipe(None), [])
    assert bench.settled(Pipe(None), ["new"])


def test_inductor_settings_hold_for_the_run_only(capsys: pytest.CaptureFixture[str]) -> None:
    """--inductor KEY=VALUE sets torch._inductor.config for the run, in every thread (the JSON line
    says which), and sets it back afterwards; a setting inductor does not have stops the bench with
    its name."""
    import torch._inductor.config as inductor_config

    from tests.helpers import in_another_thread

    before = in_another_thread(lambda: inductor_config.combo_kernels)
    argv = ["--devices", "cpu:1", "--workload", "tiny", "--seq", "16", "--steps", "1", "--warmup", "1"]
    seen: list[bool] = []
    original = bench.adamw

    def watching(used: list[str]) -> Any:  # the optimizer factory, made as the pipe is built
        seen.append(in_another_thread(lambda: inductor_config.combo_kernels))  # as a lane sees it
        return original(used)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(bench, "adamw", watching)
        bench.main([*argv, "--async", "--no-plain", "--inductor", f"combo_kernels={not before}"])
    (line,) = _json_lines(capsys.readouterr().out)
    assert line["roundpipe"]["inductor"] == {"combo_kernels": not before}
    assert seen == [not before]
    assert in_another_thread(lambda: inductor_config.combo_kernels) == before
    with pytest.raises(SystemExit, match="no setting 'not_a_setting'"):
        bench.main([*argv, "--async", "--no-plain", "--inductor", "not_a_setting=1"])


def test_inductor_cpp_wrapper_choice_reaches_roundpipe_through_the_environment(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """roundpipe holds inductor's C++ wrapper on CUDA unless ``TORCHINDUCTOR_CPP_WRAPPER`` is set,
    so --inductor cpp_wrapper=False (the Python wrapper's A/B) sets it for the run, then unsets it."""
    argv = ["--devices", "cpu:1", "--workload", "tiny", "--seq", "16", "--steps", "1", "--warmup", "1"]
    seen: list[str | None] = []
    original = bench.adamw

    def watching(used: list[str]) -> Any:  # the optimizer factory, made as the pipe is built
        seen.append(os.environ.get("TORCHINDUCTOR_CPP_WRAPPER"))
        return original(used)

    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("TORCHINDUCTOR_CPP_WRAPPER", raising=False)
        patch.setattr(bench, "adamw", watching)
        bench.main([*argv, "--async", "--no-plain", "--inductor", "cpp_wrapper=False"])
        bench.main([*argv, "--async", "--no-plain"])
        assert "TORCHINDUCTOR_CPP_WRAPPER" not in os.environ
    assert seen == ["0", None]
    assert len(_json_lines(capsys.readouterr().out)) == 2


def test_sdpa_first_puts_the_backend_ahead_for_the_run_only(capsys: pytest.CaptureFixture[str]) -> None:
    """--sdpa-first: while the pipe is built and runs, torch's sdpa order starts with the named
    backend (the order every lane reads, and the compiled layers' tracing), and flash first also
    keeps cuDNN attention off; after the run the order and the switches are torch's again, and
    the line says which backend went first and which one torch picked for the workload's heads."""
    argv = ["--devices", "cpu:1", "--workload", "tiny", "--seq", "16", "--steps", "1", "--warmup", "1"]
    before = (torch._C._get_sdp_priority_order(), torch.backends.cuda.cudnn_sdp_enabled())
    seen: list[tuple[int, bool]] = []
    original = bench.adamw

    def watching(used: list[str]) -> Any:
        seen.append((int(torch._C._get_sdp_priority_order()[0]), torch.backends.cuda.cudnn_sdp_enabled()))
        return original(used)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(bench, "adamw", watching)
        bench.main([*argv, "--async", "--no-plain", "--sdpa-first", "cudnn"])
        bench.main([*argv, "--async", "--no-plain", "--sdpa-first", "flash"])
    backend = torch.nn.attention.SDPBackend
    assert seen == [(int(backend.CUDNN_ATTENTION), True), (int(backend.FLASH_ATTENTION), False)]
    assert (torch._C._get_sdp_priority_order(), torch.backends.cuda.cudnn_sdp_enabled()) == before
    lines = [line["roundpipe"] for line in _json_lines(capsys.readouterr().out)]
    assert [line["sdpa_first"] for line in lines] == ["cudnn", "flash"]
    # the backend torch picked under the run's order: no cuDNN kernel on a CPU, so flash both times
    assert [line["attention_backend"] for line in lines] == ["flash_attention", "flash_attention"]


def test_the_cpu_model_is_read_from_cpuinfo_or_left_out(tmp_path: Path) -> None:
    host_probe = sys.modules["host_probe"]
    info = tmp_path / "cpuinfo"
    info.write_text(
        "processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\n"
    )
    assert host_probe.cpu_model(info) == "Intel(R) Xeon(R) Platinum 8480+"
    info.write_text("processor\t: 0\n")
    assert host_probe.cpu_model(info) is None
    assert host_probe.cpu_model(tmp_path / "missing") is None


# --------------------------------------------------------------------- compiles in the measured steps


def test_a_compile_inside_the_measured_steps_makes_them_run_again(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch.compile's timers (read at the start, at the window's start and at its end) say the
    first window compiled 2.5 s: it is run again, and the line keeps what the first one paid."""
    readings = iter([0.0, 0.0, 2.5])
    monkeypatch.setattr(bench, "compile_seconds", lambda: next(readings, 2.5))
    argv = ["--devices", "cpu:1", "--workload", "tiny", "--seq", "16", "--steps", "2", "--warmup", "1"]
    bench.main([*argv, "--async", "--no-plain"])
    captured = capsys.readouterr()
    (line,) = _json_lines(captured.out)
    ours = line["roundpipe"]
    (first,) = ours["remeasured_after_compile"]
    assert first["compile_s"] == 2.5 and first["tokens_per_s_wall"] > 0 and first["compiles"] == []
    assert ours["compile_s_measured"] == 0.0 and ours["warmup_steps"] == 3  # one, then the first window
    assert len(ours["losses"]) == 5 and ours["breakdown"]["iterations"] == [3, 4]
    assert "2.5 s compiling in the measured steps, measured again" in captured.err


def test_a_window_without_compiles_is_measured_once(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--devices", "cpu:1", "--workload", "tiny", "--seq", "16", "--steps", "1", "--warmup", "1"]
    bench.main([*argv, "--async", "--no-plain"])
    (line,) = _json_lines(capsys.readouterr().out)
    assert (
        line["roundpipe"]["remeasured_after_compile"] == [] and line["roundpipe"]["compiles_measured"] == []
    )
    assert line["roundpipe"]["warmup_steps"] == 1


def test_compile_events_name_the_traced_frame_and_the_failed_guard() -> None:
    compile_log = sys.modules["compile_log"]

    def scaled(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    torch._dynamo.reset()
    compiled = torch.compile(scaled, backend="eager")
    with compile_log.compile_events() as events:
        start = compile_log.time.perf_counter()
        compiled(torch.ones(3))
        compiled(torch.ones(3, dtype=torch.float64))  # a dtype guard fails: recompiled
        compiled(torch.ones(3))  # cached: no event
    found = events.since(start)
    torch._dynamo.reset()
    whats = [event["what"] for event in found]
    assert len(whats) == 3 and all("scaled" in what for what in whats), whats
    assert "start tracing" in whats[0] and whats[1].startswith("Recompiling function scaled")
    assert "dtype" in whats[1] and "start tracing" in whats[2]
    assert all(event["s"] >= 0 for event in found)
    assert compile_log.summarize("something else entirely") is None


def test_a_profiled_window_is_not_measured_again() -> None:
    assert bench.profiled_window(SimpleNamespace(torch_profile=True, memory_snapshot=None))
    assert bench.profiled_window(SimpleNamespace(torch_profile=False, memory_snapshot=Path("snap")))
    assert not bench.profiled_window(SimpleNamespace(torch_profile=False, memory_snapshot=None))


def test_compile_events_keep_the_latest_when_there_are_too_many() -> None:
    """A measured window comes after the warm-up's compiles: past the cap the oldest go."""
    compile_log = sys.modules["compile_log"]
    events = compile_log.CompileEvents()
    for n in range(compile_log.MAX_EVENTS + 5):
        record = logging.LogRecord(
            "t", logging.INFO, __file__, 1, f"torchdynamo start tracing f{n}", None, None
        )
        events.emit(record)
    whats = [event["what"] for event in events.since(0.0)]
    assert len(whats) == compile_log.MAX_EVENTS
    assert whats[0].endswith("f5") and whats[-1].endswith(f"f{compile_log.MAX_EVENTS + 4}")
