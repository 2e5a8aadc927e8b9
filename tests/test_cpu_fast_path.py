"""What EngineConfig builds on the CPU: the fast path by default, the invariant path on request."""
import pytest
import torch
from torch import nn

from slipstream import EngineConfig
from slipstream.api import assemble as assemble_mod
from slipstream.models.kernels.cpu_linear import PackedLinear, onednn_available


def build(monkeypatch, probe_calls, **kw):
    real = assemble_mod.row_multiple_for

    def counting(cfg):
        probe_calls.append(cfg)
        return real(cfg)

    monkeypatch.setattr(assemble_mod, "row_multiple_for", counting)
    return assemble_mod.assemble(EngineConfig(model="tiny-random", kv_cache_tokens=256, **kw))


@pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN")
def test_default_is_the_fast_path_without_the_probe(monkeypatch):
    calls = []
    parts = build(monkeypatch, calls)
    try:
        layer = parts.runner.model.model.layers[0]
        assert isinstance(layer.self_attn.q_proj, PackedLinear) and isinstance(layer.mlp.down_proj, PackedLinear)
        assert isinstance(parts.runner.model.lm_head, PackedLinear)  # tied: packed from the embedding
        assert layer.self_attn.compute_dtype is None and parts.runner.row_multiple == 1
        assert calls == []  # the start-up invariance probe runs only with invariance on
        assert 1 <= parts.device.forward_threads <= torch.get_num_threads()  # measured (test_cpu_threads.py)
    finally:
        parts.close()


def test_batch_invariant_keeps_the_dense_calibrated_path(monkeypatch):
    calls = []
    parts = build(monkeypatch, calls, batch_invariant=True)
    try:
        layer = parts.runner.model.model.layers[0]
        assert type(layer.self_attn.q_proj) is nn.Linear and layer.self_attn.compute_dtype == torch.float64
        assert len(calls) == 1 and parts.runner.row_multiple >= 1
        assert parts.device.forward_threads == torch.get_num_threads()  # the probe's thread count
    finally:
        parts.close()
