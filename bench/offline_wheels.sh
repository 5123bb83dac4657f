#!/usr/bin/env bash
# Wheels for a GPU machine without a package index that already has torch, transformers, peft and
# uvloop (the benchmarks' machines): roundpipe's other runtime needs (pydantic and what it imports)
# and pytest-asyncio for the `gpu` tests, built for that machine's Python and platform.
#
#   bash bench/offline_wheels.sh [DIR] [PYTHON_VERSION]    # default: .whl, 3.12 (manylinux x86-64)
#
# Then, on that machine, from the repository root:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site DIR/*.whl
#   export PYTHONPATH=/tmp/site:$PWD; python3 setup.py build_ext --inplace -q   # the planner's C loops
#
# Versions are pinned so that two downloads give the same set (pip installs one version of each).
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.whl}
PY=${2:-3.12}
mkdir -p "$DIR"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$DIR" pydantic==2.12.5 pydantic-core==2.41.5 annotated-types==0.7.0 typing-inspection==0.4.2 \
  pytest-asyncio==1.3.0
ls "$DIR"
