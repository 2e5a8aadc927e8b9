"""The peer comparison harness (tools/peers/peer_bench.py) on the CPU: transformers' continuous batching
and slipstream at depth 1 and 2 on identical weights. The GPU figures come from a lent GPU."""
import importlib.util
import json
import os
import sys

import pytest
import torch

_spec = importlib.util.spec_from_file_location("peer_bench", os.path.join(os.path.dirname(__file__), "..", "tools",
                                                                            "peers", "peer_bench.py"))
peer_bench = importlib.util.module_from_spec(_spec)
sys.modules["peer_bench"] = peer_bench
_spec.loader.exec_module(peer_bench)


def test_transformers_twin_holds_slipstreams_weights():
    from slipstream.models.llama.build import random_weights
    from slipstream.models.config import tiny_config

    hf = peer_bench.hf_twin("tiny-random", torch.float32, "cpu")
    want = random_weights(tiny_config(), peer_bench.SEED)
    got = hf.state_dict()
    for name, w in want.items():
        assert torch.equal(got[name], w), name
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()  # tied, as in slipstream


def test_harness_runs_every_system_and_they_agree_in_float32(tmp_path, capsys):
    out = tmp_path / "peer.json"
    rc = peer_bench.main(["--device", "cpu", "--dtype", "float32", "--arch", "tiny", "--concurrency", "1", "3",
                          "--prompt-len", "6", "--output-len", "5", "--repeats", "1", "--hf-compile", "off",
                          "--json-out", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    systems = ("transformers cb-auto", "transformers cb-graphs", "transformers static-compile", "slipstream d1",
               "slipstream d2")
    for system in systems:  # each configuration is a row of its own, at every N
        assert text.count(f"| {system} |") == 2, system
    assert "- command: `" in text and "- git: " in text  # provenance header
    doc = json.loads(out.read_text())
    assert doc["complete"] is True  # written after every system, marked complete at the end
    assert doc["agreement"] == [16, 16, 16, 16]  # float32, identical weights: the same greedy tokens
    assert doc["provenance"]["git"]["commit"] and "peer_bench.py" in doc["provenance"]["command"]
    for config in ("cb-auto", "cb-graphs"):  # transformers gets slipstream's KV and per-step token budgets
        hf = doc["settings"][f"transformers {config}"]
        blocks, block = hf["num_blocks x block_size"]
        assert hf["max_batch_tokens"] == 2048 and blocks * block >= 2 * 3 * (6 + 5 + 16) > (blocks - 1) * block
    # its own heuristic decides async batching (never forced), graphs are requested only in cb-graphs
    assert doc["settings"]["transformers cb-auto"]["requested"] == {"use_async_batching": None, "use_cuda_graph": None}
    assert doc["settings"]["transformers cb-graphs"]["requested"] == {"use_async_batching": None,
                                                                       "use_cuda_graph": True}
    # on the CPU (no graph backend, SDPA needs a mask) transformers' own heuristic leaves async batching off
    assert doc["settings"]["transformers cb-auto"]["use_async_batching"] is False
    assert doc["settings"]["transformers static-compile"]["cache_implementation"] == "static"
    assert set(doc["results"]) == set(systems)
    for system, by_n in doc["results"].items():
        assert set(by_n) == {"1", "3"}
        for r in by_n.values():
            assert r["tok_s"] > 0 and r["ttft_ms"] > 0 and r["itl_ms"] > 0 and r["peak_mib"] is None
            assert r["tok_s_mean"] > 0 and r["tok_s_p90"] >= r["tok_s"] - 1e-9


def test_static_generate_produces_exactly_the_requested_tokens_and_times_them():
    import peer_hf

    hf = peer_bench.hf_twin("tiny-random", torch.float32, "cpu")
    sysm = peer_hf.TransformersStaticGenerate(hf, 6, "cpu", "off")
    batch = peer_bench.prompts(2, 5, hf.config.vocab_size)
    r = sysm.run(batch)
    assert r["tok_s"] > 0 and r["itl_ms"] > 0 and r["ttft_ms"] > 0 and 2 in sysm.warm
    # the static batch's greedy tokens equal plain generate()'s
    out, times = sysm._generate(batch)
    ref = hf.generate(torch.tensor(batch), generation_config=peer_hf.hf_generation_config(6))
    assert torch.equal(out, ref) and len(times) == 6


def test_fresh_process_arguments_drop_what_the_child_gets_anew():
    argv = ["--device", "cuda", "--systems", "slipstream d1", "transformers cb-auto", "--json-out", "x.json",
            "--repeats", "2", "--no-agreement"]
    assert peer_bench._strip(argv) == ["--device", "cuda", "--repeats", "2"]


def test_bad_arguments_are_refused(capsys):
    assert peer_bench.main(["--device", "cpu", "--concurrency", "0"]) == 2
    if not torch.cuda.is_available():
        assert peer_bench.main(["--device", "cuda"]) == 2
    assert "peer_bench:" in capsys.readouterr().err


def test_llama_3_2_twin_holds_the_engines_weights_and_rope_scaling(monkeypatch):
    """`--arch llama-3.2-1b` (scaled down here): the twin holds what the engine draws (on the device, in the
    dtype) and transformers' llama3 RoPE scaling (the tiny arch's harness test checks greedy agreement)."""
    from shape_util import small_llama_3_2
    from slipstream.models.llama import build

    cfg = small_llama_3_2()
    monkeypatch.setitem(build.RANDOM, "random-llama-3.2-1b", lambda: cfg)
    build.forget_loaded()
    try:
        hf = peer_bench.hf_twin(peer_bench.ARCHS["llama-3.2-1b"], torch.float32, "cpu")
        assert hf.config.rope_parameters["rope_type"] == "llama3" and hf.config.rope_parameters["factor"] == 32.0
        d = cfg.head_dim  # transformers' scaled frequencies are slipstream's (inv_freq / rope_freq_factors)
        ours = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2).float() / d)) / torch.tensor(cfg.rope_freq_factors)
        assert torch.allclose(hf.model.rotary_emb.inv_freq.float(), ours, rtol=1e-5)
        want = build.random_weights_on(cfg, peer_bench.SEED, torch.float32, "cpu")
        got = hf.state_dict()
        assert all(torch.equal(got[name], w) for name, w in want.items())
    finally:
        build.forget_loaded()


def test_hf_config_refuses_a_rope_scaling_that_is_not_the_configs():
    import pytest

    from hf_oracle import hf_llama_config
    from shape_util import small_llama_3_2
    from slipstream.models.config import LLAMA_3_2_ROPE

    cfg = small_llama_3_2()
    with pytest.raises(ValueError, match="rope_scaling"):
        hf_llama_config(cfg)  # scaled, but no scaling given
    with pytest.raises(ValueError, match="rope_freq_factors"):
        hf_llama_config(cfg, {**LLAMA_3_2_ROPE, "factor": 8.0})
