#!/usr/bin/env bash
# The `gpu`-marked tests, one process per test, each under its own time limit.
#
# Why one process per test: a device call is a few minutes, and one test that hangs (a stream
# waiting on work that never comes, a compile that never ends) in a single pytest process takes
# every test after it, and the summary line, with it. Here a hung test costs its own limit and is
# named; the others still run and report. Each limit ends its test with SIGKILL five seconds
# after SIGTERM: a library's SIGTERM handler (a training command's stop request, a compile
# worker pool) must not keep it alive.
#
#   OUT=/path bash bench/gpu_tests.sh                                  # every gpu test
#   OUT=/path bash bench/gpu_tests.sh tests/test_cuda.py -k "budget"    # pytest selection arguments
#
# Writes $OUT/gpu_tests.log (each test's output, in order) and prints one line per test (passed,
# failed, skipped, or "TIMED OUT after N s") with the failure's last lines. PER_TEST_S (default
# 180) is each test's limit; DEADLINE_S (default 540) bounds the whole call, and tests left when
# it is near are listed as not run.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-bench-out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PER_TEST_S=${PER_TEST_S:-180}
DEADLINE_S=${DEADLINE_S:-540}
START=$(date +%s)
LOG="$OUT/gpu_tests.log"
: >"$LOG"

mapfile -t IDS < <(python3 -m pytest -m gpu -p no:cacheprovider --collect-only -o addopts="" -q "${@:-tests}" 2>/dev/null |
  grep '::')
echo "== ${#IDS[@]} gpu tests, ${PER_TEST_S}s each at most"
for id in "${IDS[@]}"; do
  left=$((DEADLINE_S - ($(date +%s) - START)))
  if ((left < 20)); then
    echo "   not run (${left}s left): $id"
    continue
  fi
  limit=$((PER_TEST_S < left ? PER_TEST_S : left))
  begun=$(date +%s)
  echo "===== $id" >>"$LOG"
  timeout --kill-after=5 "$limit" python3 -m pytest -m gpu -p no:cacheprovider -o addopts="" -q --tb=short "$id" >>"$LOG" 2>&1
  status=$?
  took=$(($(date +%s) - begun))
  if ((status == 124 || status == 137)); then
    echo "   TIMED OUT after ${took}s: $id"
  else
    verdict=$(tail -n 1 "$LOG" | sed 's/=//g; s/^ *//')
    echo "   ${verdict} (${took}s): $id"
    if ((status != 0 && status != 5)); then
      grep -E '^E |Error|assert' "$LOG" | tail -n 6 | cut -c1-300 | sed 's/^/      /'
    fi
  fi
done
