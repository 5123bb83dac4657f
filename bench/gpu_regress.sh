#!/usr/bin/env bash
# Workloads A and long (bench/gpu_throughput.py) on this tree and on an older one, alternated on
# one machine, for the check that a change made nothing slower: the GPU's speed moves between
# machines, so only runs of one call compare.
#
#   OLD=.oldrp OUT=/path bash bench/gpu_regress.sh          # .oldrp: `git archive REV | tar -x -C .oldrp`
#   WORKLOADS="B C" OLD=.oldrp bash bench/gpu_regress.sh     # other workloads (default: A long)
#   PAIRS=1 WORKLOADS="long B C" OLD=.oldrp bash bench/gpu_regress.sh   # one old/new pair each
#   PAIRS=1 WORKLOADS=E OLD=.oldrp558 bash bench/gpu_regress.sh         # a change to one device's schedule on E
#
# Each workload runs old, new, old, new (PAIRS pairs, default 2) while the call's time lasts (on
# an H100 A took ~1.5 min a run; long ~2, B ~1, C ~2 estimated), with the arguments
# docs/performance.md gives it; roundpipe side only, async. Writes
# $OUT/regress.jsonl (one line per run, "tree" added) and prints tokens/s per run. DEADLINE_S
# (default 540) bounds the whole call.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-bench-out}
OLD=$(cd "${OLD:?set OLD to the older tree}" && pwd)
DEVICES=${DEVICES:-cuda:0}
DEADLINE_S=${DEADLINE_S:-540}
START=$(date +%s)
mkdir -p "$OUT"
(cd "$OLD" && python3 setup.py build_ext --inplace -q >/dev/null 2>&1)
# name -> "expected_s|arguments": a run's expected seconds on an H100 (imports, build, compile,
# steps); a pair starts only when both its runs fit in what is left, so no old run goes without
# its new one.
declare -A ARGS=(
  [A]="90|--workload A --budget 4GiB --steps 3 --warmup 2"
  [B]="70|--workload B --budget 12GiB --steps 3 --warmup 2"
  [C]="130|--workload C --steps 3 --warmup 2"
  [long]="150|--workload long --recompute-grain stage --steps 1 --warmup 1"
  [E]="200|--workload E --warmup 2 --steps 3"  # 32B LoRA, 24 GiB (gpu_big.sh's E); ~82 GiB of host (layer inputs too)
  [E-inputs]="230|--workload E --warmup 2 --steps 3 --recompute-grain layer_input"
  [tiny]="20|--workload tiny --steps 1 --warmup 1"  # WORKLOADS=tiny DEVICES=cpu:1 OLD=.: a smoke run
)
RUNS=()
skip_pair=0
for name in ${WORKLOADS:-A long}; do
  for ((pair = 0; pair < ${PAIRS:-2}; pair++)); do
    for tree in old new; do RUNS+=("$tree|${ARGS[$name]:?unknown workload $name}"); done
  done
done
for run in "${RUNS[@]}"; do
  IFS='|' read -r tree expect args <<<"$run"
  left=$((DEADLINE_S - ($(date +%s) - START)))
  [[ $tree == old ]] && skip_pair=$((left < 2 * expect))  # the new run follows its old one
  if ((skip_pair || left < 60)); then
    echo "== $tree $args skipped: ${left}s left, a pair needs about $((2 * expect))s"
    continue
  fi
  dir=$PWD; [[ $tree == old ]] && dir=$OLD
  # shellcheck disable=SC2086  # the arguments are words
  line=$(cd "$dir" && PYTHONPATH="$dir${PYTHONPATH:+:$PYTHONPATH}" timeout "$left" python3 bench/gpu_throughput.py \
    --devices "$DEVICES" --async --loss-lag 1 --no-plain $args 2>/dev/null | grep '^{' | tail -1)
  [[ -z $line ]] && { echo "== $tree $args: no result"; continue; }
  echo "$line" | python3 -c 'import json,sys; d=json.load(sys.stdin); d["tree"]=sys.argv[1]; print(json.dumps(d))' "$tree" \
    >>"$OUT/regress.jsonl"
  echo "== $tree $args: $(echo "$line" | python3 -c 'import json,sys; r=json.load(sys.stdin)["roundpipe"]; print(r.get("tokens_per_s"), "tok/s", r.get("error", ""))')"
done
