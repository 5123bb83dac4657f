#!/usr/bin/env bash
# The big-model and long-context GPU benchmarks (bench/gpu_throughput.py workloads E, E-nf4, F, G,
# G-nf4, D, D16, D2), for one device call of at most 9 minutes each.
#
# Why a script: device time is short and every call must give figures. Each workload runs in its
# own process (a 32B bf16 base pins ~70 GiB of host memory, which the pinned allocator keeps until
# the process ends), async mode only, with warm-up and measured steps sized to its expected step
# time, each loss read one step late (so tokens/s is the measured steps' wall time, drain
# included, not the host's time to issue them), and under a time limit cut from what is left of
# the call's deadline, so a slow workload loses its own line, never the ones after it. Most
# important first within each group.
#
#   OUT=/path bash bench/gpu_big.sh 1       # F, E-nf4, E       (70B nf4; 32B nf4; 32B bf16)
#   OUT=/path bash bench/gpu_big.sh 2       # G                 (8B, one 262,144-token sequence)
#   OUT=/path bash bench/gpu_big.sh 3       # D, D2, D16        (30B-A3B; GPT-OSS-20B; 30B-A3B x 16)
#   OUT=/path bash bench/gpu_big.sh 4       # G-nf4 at 131,072 tokens, then at 262,144
#   OUT=/path bash bench/gpu_big.sh F D     # named workloads, default settings
#   OUT=/path bash bench/gpu_big.sh F-profile D16-profile   # torch.profiler summaries, 4 layers each
#   OUT=/path bash bench/gpu_big.sh F-snapshot           # where a measured step's peak bytes were
#   OUT=/path bash bench/gpu_big.sh D16-python D16          # a workload and one of its VARIANTs
#
# Writes $OUT/big.jsonl (one JSON line per workload), $OUT/<name>.log (progress lines on stderr as
# the run goes: model built, pipe open, each step; then its JSON line), and prints a summary line
# per workload. DEADLINE_S (default 530) bounds the whole call; EXTRA adds arguments to every
# workload (EXTRA="--save-trace $OUT/traces": each run's trace, for `roundpipe trace`); LIMIT_S
# replaces every workload's own limit (building the mixture-of-experts layers' C++ wrappers on a
# cold machine can take minutes).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-bench-out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
DEVICES=${DEVICES:-cuda:0}  # DEVICES=cpu:1 bash bench/gpu_big.sh tiny: the script's own smoke run
START=$(date +%s)
DEADLINE_S=${DEADLINE_S:-530}

# name -> "limit_s|least_s|gpu_throughput.py arguments": a workload runs for at most limit_s and
# only when least_s are left. Expected wall times: imports, build, profile, compile, steps. On an
# H100: F 213 s with one measured step of 12 s, D 81 s at 2.6 s a step, E 6.0 s a step, D16 185 s
# at 5.3 s a step; G 3-5 min a step at 262,144 tokens (the G runs profile one decoder layer, not
# 32, RunConfig.profile).
declare -A JOB=(
  [F]="300|200|--workload F --warmup 2 --steps 2"             # ~4 min: 12 s/step, build ~25 s; two
  # measured steps: with one, its final drain (~1% of it) counted against 1.4K (1,369 wall, 1,385 trace)
  [E-nf4]="200|110|--workload E-nf4 --warmup 2 --steps 2"     # ~2.5 min
  [E]="300|150|--workload E --warmup 2 --steps 3"             # ~2.5 min; over 200 s first on a cold
  # machine (building the layer-input variants' kernels); ~82 GiB of host, inputs too
  [G]="570|300|--workload G --warmup 0 --steps 1 --profile one_per_kind"  # ~4-6 min at 262,144 tokens
  [G-nf4]="570|300|--workload G-nf4 --warmup 0 --steps 1 --profile one_per_kind"
  [G131]="300|200|--workload G --seq 131072 --warmup 1 --steps 1 --profile one_per_kind"  # ~3 min
  [G131-nf4]="300|200|--workload G-nf4 --seq 131072 --warmup 1 --steps 1 --profile one_per_kind"
  # Mixture-of-experts layers build C++ wrappers: ~2.7 min for D16 or D2 on a cold inductor cache
  # (an H100), under 2 min when the layer class's kernels are cached.
  [D]="300|150|--workload D --warmup 2 --steps 2"             # ~1.7-3 min; a cold D-choicesum over 240 s
  [D16]="270|180|--workload D16 --warmup 2 --steps 2"         # ~2.7 min
  [D2]="270|180|--workload D2 --warmup 2 --steps 2"           # ~2.7 min
  # Qwen3-1.7B under a 4 GiB budget (workload A of gpu_regress.sh), for its variants below (A and
  # A-balanced cut the same 19-slot plan on an H100: 27,164 and 27,072 tok/s).
  [A]="150|90|--workload A --budget 4GiB --steps 3 --warmup 2"
  # Qwen3-1.7B, all weights trained, 32 x 2048 under 12 GiB (workload B of gpu_regress.sh), for
  # B-inputs: does every layer from its saved input cost B (33,235 against 34,646 tok/s while
  # inputs queued behind the next run's)?
  [B]="120|70|--workload B --budget 12GiB --steps 3 --warmup 2"
  # Qwen3-14B, LoRA r16, 4 x 4096 under 24 GiB (workload C of gpu_regress.sh), for C-inputs.
  [C]="200|130|--workload C --steps 3 --warmup 2"
)
# NAME-VARIANT runs NAME's job (above) with the variant's arguments: D16-python, A-balanced, ...
declare -A VARIANT=(
  # The layers eager (RunConfig.compile=False): does a mixture-of-experts layer issue faster from
  # eager dispatch than from inductor's compiled code? (D's issuing paced its compute lane.)
  [eager]="--compile false"
  # The frozen base in 4 bits (D-nf4, D16-nf4, D2-nf4): experts cross the link at a quarter of
  # their bf16 bytes and, dense once a stage run (RunConfig.dequantize), compute as on bf16.
  [nf4]="--base-format nf4"
  # The evaluated choice's finest stages (RunConfig's one-device default is the fewest stages that
  # fit, roundpipe.plan.coarse): the A/B behind that default.
  [balanced]="--one-device-stages balanced"
  # Coarse backward stages of at most 1, 2 or 3 layers: more recomputes leave out their last
  # layer's frozen down projection (roundpipe.model.frozen_tail), for more slots and activations
  # over the link. E-back1 at 24 GiB ran out of memory, 5.3 GiB above its prediction (design.md).
  [back1]="--backward-stage-layers 1"
  [back2]="--backward-stage-layers 2"
  [back3]="--backward-stage-layers 3"
  # Every backward-stage layer recomputed from its own input, saved by the forward to the host:
  # every recompute skips its frozen down projection without more slots (design.md); on D, D16
  # and D2 the experts' down products and the sum of the choices (model/experts_tail.py).
  [inputs]="--recompute-grain layer_input"
  # Each backward stage recomputed from its own input only: what "auto" (the default) chooses
  # where a condition of roundpipe/planning/grain.py fails; E-stage, C-stage against E, C.
  [stage]="--recompute-grain stage"
  # Eight parameter parts at most on the link per run, so an input waits behind fewer of them
  # (roundpipe/sched/param_uploads.py); E-parts8, D-parts8, E-inputs then E-inputs8 for both
  [parts8]="--upload-parts-ahead 8"
  [inputs8]="--recompute-grain layer_input --upload-parts-ahead 8"
  # Every recompute computes its last layer's frozen down projection (RunConfig.skip_unread_tail).
  [fulltail]="--skip-unread-tail false"
  # Under layer_input, each layer's input saved without its post-attention residual, so every
  # recompute computes o_proj (RunConfig.save_residuals; model/attention_residual.py): E against
  # E-noresiduals (the line's save_residuals says whether "auto" saved them); a named
  # layer_input saves them wherever the host has the bytes: E-inputs against E-inputsnores
  [noresiduals]="--save-residuals false"
  # Every stage run of a 4-bit base holds dense copies, the fused stage's too (RunConfig.dequantize
  # "run"; "auto" may leave the fused stage per call for more layers in it, planning/even_stages.py):
  # E-nf4 against E-nf4-copies
  [copies]="--dequantize run"
  [inputsnores]="--recompute-grain layer_input --save-residuals false"
  # Fewer kernel launches per compiled layer: inductor's horizontal fusion of independent kernels,
  # or its more aggressive fusion.
  [combo]="--inductor combo_kernels=True"
  [aggressive]="--inductor aggressive_fusion=True"
  # Launches from inductor's generated Python instead of its C++ wrapper (roundpipe's default on
  # CUDA; the experts then call torch's grouped product directly).
  [python]="--inductor cpp_wrapper=False"
  # Four microbatches' inputs ahead of their computes (device_plan.FLOW_DEPTH): the host may issue
  # more of a stage's computes before its weights land (the default is two).
  [flow4]="--flow-depth 4"
  # Upload pieces of 64 MiB (RunConfig.chunk_bytes; the default is 256): 4x the param_up tasks
  # (D16 issued 1,721 an iteration so, each on the host's lanes, which the compute lane's issuing
  # shares the interpreter with), each holding the link a quarter as long ahead of an input
  [64MiB]="--chunk-bytes 64MiB"
  [256MiB]="--chunk-bytes 256MiB"
  # Each token's expert rows summed by the Triton kernels of roundpipe.model.choice_sum (forward
  # combine, its backward, the gather's backward; the default on CUDA) or by inductor's fused
  # torch ops (nochoicesum): the A/B behind that default.
  [choicesum]="--choice-sum on"
  [nochoicesum]="--choice-sum off"
  # torch's flash attention kernel instead of cuDNN's, which torch 2.11 with cuDNN 9.19 runs by
  # default on Hopper cards (bench/gpu_attention.py times both kernels alone)
  [flash]="--sdpa-first flash"
  # torch.profiler over one step of 4 layers (bench/torch_profile.py; the later --warmup and
  # --steps win): what F's layer computes, what D's host issues (top_host), whether D16's layers
  # are short of launches, where E's 9 ms backward of a layer goes; not the workload's tokens/s
  [profile]="--layers 4 --warmup 1 --steps 1 --torch-profile"
  # Where a measured step's peak bytes were (bench/gpu_memory_snapshot.py), in $OUT/NAME/: which
  # run's weights, copies and activations F held at 18.89 GiB against 17.74 predicted
  [snapshot]="--warmup 2 --steps 1 --memory-snapshot SNAPSHOT_DIR"
)
job_spec() {  # "limit_s|least_s|arguments" of a workload name
  local name=$1 base=${1%-*} variant=${1##*-}
  if [[ -n ${JOB[$name]:-} ]]; then
    echo "${JOB[$name]}"
  elif [[ $name == *-* && -n ${JOB[$base]:-} && -n ${VARIANT[$variant]:-} ]]; then
    echo "${JOB[$base]} ${VARIANT[$variant]}"
  else
    echo "300|60|--workload $name --warmup 2 --steps 2"
  fi
}
case "${1:-1}" in
  1) NAMES=(F E-nf4 E) ;;
  2) NAMES=(G) ;;
  3) NAMES=(D D2 D16) ;;
  4) NAMES=(G131-nf4 G-nf4) ;;
  *) NAMES=("$@") ;;
esac

summary() {  # the figures a reader looks for first, from the workload's JSON line
  python - "$1" <<'PY'
import json, sys
lines = [l for l in open(sys.argv[1]) if l.startswith("{")]
if not lines:
    print("   no result line"); sys.exit()
d = json.loads(lines[-1]); r = d["roundpipe"]
if "error" in r:
    print("   ERROR", r["error"][:300]); sys.exit()
keys = ["tokens_per_s", "peak_gib", "predicted_peak_gib", "host_rss_gib", "h2d_bytes_per_iteration",
        "h2d_gbps_achieved", "h2d_gbps_probe", "link_busy", "compute_fraction", "bubble",
        "exposed_transfer", "host_bound", "link_bound_tokens_per_s", "of_link_bound", "slots", "build_s",
        "long_row_slicing", "prefetch_stages", "dense_weights", "attention_backend", "gap_causes_ms",
        "upload_parts_ahead", "compile_s_measured", "alloc_retries_measured", "dense_per_call_layers", "plan"]
shown = {k: r.get(k) for k in keys}
shown["issue_ms_per_iteration"] = r.get("breakdown", {}).get("issue_ms_per_iteration")  # against busy_ms
shown["slowest_compute_ms"] = [(c["ms"], c["iteration"]) for c in r.get("slowest_computes", [])[:3]]
shown["param_up_gbps"] = r.get("param_up_gbps")  # per iteration: the planner's median, summed spans, union
print("  ", json.dumps(shown))
print("   host", json.dumps(d.get("host")))  # the CPU and its issue speed: host-bound shares differ by machine
if "torch_profile" in r:  # a -profile variant: device time per step by kernel kind
    print("   kernels", json.dumps(r["torch_profile"].get("kernels_by_kind")))
if "memory_snapshot" in r:  # a -snapshot variant: the peak's bytes by task, the runtime's holdings
    print("   snapshot", json.dumps(r["memory_snapshot"])[:1500])
PY
}

for name in "${NAMES[@]}"; do
  spec=$(job_spec "$name")
  IFS='|' read -r limit least args <<<"$spec"
  limit=${LIMIT_S:-$limit}  # LIMIT_S: one limit for every workload (a cold C++-wrapper compile)
  left=$((DEADLINE_S - ($(date +%s) - START)))
  if ((left < least)); then
    echo "== $name skipped: ${left}s left of the call's ${DEADLINE_S}s, it needs about ${least}s"
    continue
  fi
  ((limit > left)) && limit=$left
  args=${args//SNAPSHOT_DIR/$OUT/$name}
  echo "== $name: $args (limit ${limit}s, $(date +%T))"
  # shellcheck disable=SC2086  # the arguments are words
  timeout --kill-after=15 "$limit" python bench/gpu_throughput.py --devices "$DEVICES" --async --loss-lag 1 \
    --out "$OUT/big.jsonl" $args ${EXTRA:-} >"$OUT/$name.log" 2>&1
  echo "   exit $? after $(($(date +%s) - START))s of the call"
  summary "$OUT/$name.log"
done
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader 2>/dev/null | sed 's/^/   /'
