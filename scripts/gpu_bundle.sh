#!/usr/bin/env bash
# .gpu-bundle/: wheels of what aftgen's serve and test extras need and a GPU image may lack, and of the CLI's
# typer and click (the tests read their output), pinned to the versions of this venv, for CPython 3.12 on
# x86-64 Linux; and a copy of the corpus if there is one. On the machine, with its own torch:
#   python3 -m pip install --no-index --no-deps --target /tmp/site .gpu-bundle/wheels/*.whl
#   PYTHONPATH=/tmp/site python3 -m pip install --no-index --no-deps --no-build-isolation -e .
# Usage: scripts/gpu_bundle.sh PYTHON [CORPUS]
set -euo pipefail
cd "$(dirname "$0")/.."
python=$1
corpus=${2:-}
names="typer click anyio starlette uvicorn openai httpx2 httpcore2 truststore jiter pydantic pydantic-core sniffio annotated-types
typing-inspection typing-extensions"
rm -rf .gpu-bundle
mkdir -p .gpu-bundle/wheels
pins=$("$python" -m pip list --format=freeze 2>/dev/null | grep -i -E "^($(echo $names | tr ' ' '|' | sed 's/-/[-_]/g'))==" || true)
platforms=""
for n in 17 27 28 34 35; do platforms+=" --platform manylinux_2_${n}_x86_64"; done
# shellcheck disable=SC2086
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  $platforms --platform manylinux2014_x86_64 -d .gpu-bundle/wheels $pins
if [[ -n $corpus && -f $corpus ]]; then
  cp "$corpus" .gpu-bundle/tinyshakespeare.txt
fi
du -sh .gpu-bundle
ls .gpu-bundle/wheels
