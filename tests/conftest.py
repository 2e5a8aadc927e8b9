import atexit
import os
import shutil
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The converted-weights cache on, in a directory of this test session (never the user's): the
# SmolLM tests then dequantise the GGUF once, not at every engine start (worker processes inherit
# it). Cache tests set their own directory.
if "SLIPSTREAM_CACHE_DIR" not in os.environ:
    os.environ["SLIPSTREAM_CACHE_DIR"] = tempfile.mkdtemp(prefix="slipstream-test-cache-")
    atexit.register(shutil.rmtree, os.environ["SLIPSTREAM_CACHE_DIR"], True)
os.environ.setdefault("SLIPSTREAM_WEIGHT_CACHE", "1")
os.environ.setdefault("SLIPSTREAM_CHECK_INVARIANTS", "1")  # Sequence.check() on every row at every commit
sys.path.insert(0, os.path.dirname(__file__))  # test helpers (fake_runner) import by name

import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def loaded():
    """The default model (SmolLM2-135M-Instruct GGUF) as loaded by slipstream, shared by all tests."""
    from slipstream.models.loader import DEFAULT_MODEL, load_model

    return load_model(DEFAULT_MODEL)


@pytest.fixture(scope="session")
def hf_model(loaded):
    """The same GGUF loaded by transformers (offline): the correctness oracle."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(loaded.path.parent), gguf_file=loaded.path.name,
                                                dtype=torch.float32).eval()
