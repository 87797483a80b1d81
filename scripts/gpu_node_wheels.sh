#!/bin/sh
# The wheels scripts/gpu_check_node.py needs on the H200 device machine beyond its image
# (Python 3.12, no network; torch, transformers, safetensors, tokenizers, numpy, psutil,
# pyarrow and httpx are there): msgspec and isal. Downloaded into .whl/ (ignored by
# git); carry .whl and start the device command with
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#       --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD/shared:$PWD/daemon:$PWD/tui
set -e
cd "$(dirname "$0")/.."
mkdir -p .whl
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    -d .whl msgspec==0.23.0 isal==1.9.1
ls -la .whl
