import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("SLIPSTREAM_WEIGHT_CACHE", "0")  # tests never write the user's cache; cache tests opt in
if "SLIPSTREAM_CACHE_DIR" not in os.environ:  # the compiled CPU kernels: built once per run, shared by subprocesses
    import tempfile

    os.environ["SLIPSTREAM_CACHE_DIR"] = tempfile.mkdtemp(prefix="slipstream-test-cache-")
os.environ.setdefault("SLIPSTREAM_CHECK_INVARIANTS", "1")  # Sequence.check() on every row at every commit
sys.path.insert(0, os.path.dirname(__file__))  # test helpers (fake_runner) import by name
# test-and-tool helpers that are not the library (host_batch, hf_oracle, launch_counter)
sys.path.insert(1, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", "common"))

import pytest  # noqa: E402
import torch  # noqa: E402

import slipstream.gc_freeze  # noqa: E402

slipstream.gc_freeze.COLLECT_FIRST = False  # hundreds of engine starts: no full collection at each


@pytest.hookimpl(trylast=True)  # after -m / -k deselected what will not run
def pytest_collection_modifyitems(config, items):
    if not config.option.collectonly:
        for item in items:
            if item.nodeid.endswith("test_typing.py::test_the_package_type_checks"):
                item.module.start_early()  # mypy beside the tests that run before it
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def loaded():
    """The default model (SmolLM2-135M-Instruct GGUF) as loaded by slipstream, shared by all tests."""
    from slipstream.models.loading.loader import DEFAULT_MODEL, load_model

    return load_model(DEFAULT_MODEL)


@pytest.fixture(scope="session")
def hf_model(loaded):
    """The same GGUF loaded by transformers (offline): the correctness oracle."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(loaded.path.parent), gguf_file=loaded.path.name,
                                                dtype=torch.float32).eval()


def pytest_sessionfinish(session):
    typing = sys.modules.get("test_typing")
    if typing is not None:
        typing.stop_early()  # (a run stopped before the check: no mypy left behind)
