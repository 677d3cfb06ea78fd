#!/usr/bin/env bash
# Wheels for an offline CUDA machine whose Python already has torch, transformers, accelerate, peft, rich,
# psutil, matplotlib, pytest and numpy (a cluster's image, a lent GPU box with no internet): what dist_train,
# bench/gpu_check.py and tests/launched/test_cuda.py need beside them. W&B is left out (gpu_check logs with
# logger=none); add it with its dependencies if the machine should log.
#
#   bash bench/wheelhouse.sh [DIR] [PYTHON_VERSION]        # default: .whl 3.12
#
# Then, on the machine, from a copy of this checkout:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site DIR/*.whl && export PYTHONPATH=/tmp/site
#   python3 bench/gpu_check.py
#
# Binary wheels are downloaded for the target Python (manylinux x86-64); the two packages published only as
# source (antlr4-python3-runtime, DeepSpeed without prebuilt ops) are built here into pure-Python wheels.
# The versions are the ones this project is tested with (pip freeze of `make install`).
set -euo pipefail
dir=${1:-.whl}
py=${2:-3.12}
here=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-$here/.venv/bin/python}
mkdir -p "$dir"

binary=(
  hydra-core==1.3.8 omegaconf==2.3.1
  hjson==3.1.0 pydantic==2.14.3 pydantic-core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5
  lion-pytorch==0.2.5
)
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version "$py" --implementation cp \
  "${platforms[@]}" -d "$dir" "${binary[@]}"
# source-only packages: pure-Python wheels (DeepSpeed compiles its ops at run time, where they are used)
DS_BUILD_OPS=0 "$python" -m pip wheel -q --no-deps --no-build-isolation -w "$dir" \
  antlr4-python3-runtime==4.9.3 deepspeed==0.19.8
ls -l "$dir"
du -sh "$dir"
