"""The curl and OpenAI-SDK examples in docs/serving.md run against a real server and succeed."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from serve_util import ThreadServer
from worker_util import engine_config

from slipstream.serve import EngineBackend
from slipstream.serve.sse import parse

DOC = (Path(__file__).parent.parent / "docs" / "serving.md").read_text()
BLOCKS = re.findall(r"```(bash|python)\n(.*?)```", DOC, re.S)
DOC_URL = "http://127.0.0.1:8000"


@pytest.fixture(scope="module")
def server():
    with ThreadServer(EngineBackend(engine_config())) as s:
        yield s


def test_the_doc_has_examples():
    kinds = [k for k, _ in BLOCKS]
    assert kinds.count("bash") >= 3 and kinds.count("python") >= 2


@pytest.mark.parametrize("code", [c for k, c in BLOCKS if k == "bash"])
def test_curl_example(server, code):
    out = subprocess.run(["bash", "-c", code.replace(DOC_URL, server.url)], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    body = parse(out) if out.startswith("data: ") else [json.loads(out)]
    # (a Responses API body has "error": null)
    assert body and all(b.get("error") is None for b in body if isinstance(b, dict)), out
    if body[-1] == "[DONE]":
        assert body[-2]["usage"]["completion_tokens"] > 0
    else:  # a chat or completion body, or a Responses API one (output_tokens)
        usage = body[0]["usage"]
        assert usage.get("completion_tokens", usage.get("output_tokens")) > 0


@pytest.mark.parametrize("code", [c for k, c in BLOCKS if k == "python"])
def test_sdk_example(server, code):
    out = subprocess.run([sys.executable, "-c", code.replace(DOC_URL, server.url)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip()
