#!/usr/bin/env bash
# Download, here, the wheels a lent GPU machine lacks (its image has torch, triton, cupy,
# transformers, uvloop, pytest, hypothesis, tqdm, jinja2, prometheus-client, but none of these),
# for its Python 3.12, into .whl/ (in .gitignore), to be carried with `run(carry=[".whl"])`.
# Not carried: the `serve` extra and the OpenAI client (fastapi, starlette, pydantic, pydantic-core, uvicorn,
# httptools, websockets, openai, ... : 15 wheels, 6.9 MB on 2026-11-25) nor ray. No GPU stage serves HTTP, their
# pins against the image's anyio/typing-extensions are untried there, and the tests that need them skip
# (tests/test_gpu_image_collect.py checks that every cuda test is still collected without them).
set -euo pipefail
cd "$(dirname "$0")/../.."  # the repository root
mkdir -p .whl
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" -d .whl \
    msgspec structlog gguf llguidance pyzmq pytest-asyncio jsonschema jsonschema-specifications referencing rpds-py
du -sh .whl
