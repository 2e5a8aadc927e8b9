#!/usr/bin/env bash
# Download, here, the wheels a lent GPU machine lacks (its image has torch, triton, cupy,
# transformers, uvloop, pytest, hypothesis, tqdm, jinja2, prometheus-client, but none of these),
# for its Python 3.12, into .whl/ (in .gitignore), to be carried with `run(carry=[".whl"])`.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" -d .whl \
    msgspec structlog gguf llguidance pyzmq pytest-asyncio jsonschema jsonschema-specifications referencing rpds-py
du -sh .whl
