"""The real runner and the test fake implement the same Runner protocol, with the same signatures."""
import inspect

from fake_runner import FakeRunner
from slipstream.runtime.model_runner import ModelRunner
from slipstream.runtime.runner_api import Runner


def public_methods(cls):
    return {n: inspect.signature(f) for n, f in inspect.getmembers(cls, inspect.isfunction) if not n.startswith("_")}


def test_model_runner_and_fake_share_the_runner_protocol():
    wanted = public_methods(Runner)
    for impl in (ModelRunner, FakeRunner):
        have = public_methods(impl)
        for name, sig in wanted.items():
            assert name in have, f"{impl.__name__} lacks {name}"
            assert list(have[name].parameters) == list(sig.parameters), f"{impl.__name__}.{name}{have[name]} vs {sig}"
            assert inspect.iscoroutinefunction(getattr(impl, name)) == inspect.iscoroutinefunction(getattr(Runner, name))
    assert isinstance(FakeRunner(4), Runner)
