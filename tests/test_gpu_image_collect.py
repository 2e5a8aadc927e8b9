"""The lent GPU machine's image collects every `cuda` test (what `tools/gpu/gpu_check.sh tests` runs).

The image has torch, triton, cupy, transformers, httpx, hypothesis, pytest and the scientific stack
(/work/.library/device/KINDS.md); tools/gpu/gpu_wheels.sh carries slipstream's own dependencies it lacks
plus pytest-asyncio and jsonschema. What is left missing is hidden here: a test module importing
one of these at its top must skip (pytest.importorskip), or collection stops with errors and not
one CUDA test runs.
"""
import re

from hidden_packages import finish, hider, start_python

# on neither the image nor the carried wheels (the `serve` and `ray` extras and what they pull in)
MISSING_ON_GPU_IMAGE = ("fastapi", "starlette", "uvicorn", "openai", "pydantic", "httptools", "websockets", "ray")

COLLECT = """
import sys, pytest
sys.exit(pytest.main(["-m", "cuda", "--collect-only", "-q", "-p", "no:cacheprovider", "tests/"]))
"""


def collected(proc) -> tuple[set[str], str]:
    proc = finish(proc)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    ids = {line for line in proc.stdout.splitlines() if "::" in line}
    return ids, proc.stdout.strip().splitlines()[-1]


def test_the_gpu_image_collects_every_cuda_test():
    plain, image = start_python(hider(()) + COLLECT), start_python(hider(MISSING_ON_GPU_IMAGE) + COLLECT)  # side by side
    everything, _ = collected(plain)
    on_image, summary = collected(image)
    assert len(everything) > 50  # every module with CUDA tests was collected at all
    assert not re.search(r"\berrors?\b", summary), summary
    assert on_image == everything, sorted(everything ^ on_image)
