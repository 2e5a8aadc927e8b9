"""tools/peers/llamacpp_bench.py: reading llama-batched-bench's output (the binary itself runs in tools/gpu/gpu_check.sh)."""
import importlib.util
import json
import os
import sys

import pytest

_path = os.path.join(os.path.dirname(__file__), "..", "tools", "peers", "llamacpp_bench.py")
_spec = importlib.util.spec_from_file_location("llamacpp_bench", _path)
llamacpp_bench = importlib.util.module_from_spec(_spec)
sys.modules["llamacpp_bench"] = llamacpp_bench
_spec.loader.exec_module(llamacpp_bench)


def _line(pl, t_pp, t_tg, tg=127):
    return json.dumps({"pp": 64, "tg": tg, "pl": pl, "n_kv": 0, "t_pp": t_pp, "speed_pp": 1.0, "t_tg": t_tg,
                       "speed_tg": pl * tg / t_tg, "t": t_pp + t_tg, "speed": 1.0})


def test_parse_drops_the_warmup_pass_and_counts_the_prefill_token():
    stdout = "\n".join([_line(8, 9.0, 9.0), _line(8, 0.010, 1.27), _line(8, 0.012, 1.27), _line(8, 0.011, 1.524)])
    log = ("load_tensors:        CUDA0 model buffer size =   256.60 MiB\n"
           "llama_kv_cache:        CUDA0 KV buffer size =   780.00 MiB\n"
           "sched_reserve:      CUDA0 compute buffer size =   120.25 MiB\n"
           "sched_reserve:  CUDA_Host compute buffer size =    10.00 MiB\n")
    r = llamacpp_bench.parse_run(stdout, log, 8, 128)
    assert len(r["repeats"]) == 3  # the 9-second warm-up pass is gone
    assert r["itl_ms"] == pytest.approx(10.0)  # median of 1.27 s / 127 steps
    assert r["ttft_ms"] == pytest.approx(11.0)
    assert r["tok_s"] == pytest.approx(8 * 128 / 1.282)  # L = 1 token from prefill + 127 decode steps
    assert r["buffers_mib"]["KV (CUDA0)"] == 780.0 and r["buffers_total_mib"] == pytest.approx(1166.85)


def test_parse_refuses_a_run_without_measured_passes():
    with pytest.raises(RuntimeError, match="1 result lines"):
        llamacpp_bench.parse_run(_line(1, 0.1, 1.0), "", 1, 128)


def test_a_prebuilt_dist_names_its_snapshot(tmp_path):
    """tools/peers/llamacpp_peer.sh dist keeps .snapshot-commit/.snapshot-origin beside bin/ (no CMakeCache)."""
    assert llamacpp_bench.llamacpp_commit(str(tmp_path)) == "unknown"
    (tmp_path / ".snapshot-commit").write_text("0c1e570 2026-10-01\n")
    (tmp_path / ".snapshot-origin").write_text("llama-cpp-python 0.3.36\n")
    assert llamacpp_bench.llamacpp_commit(str(tmp_path)) == "0c1e570 2026-10-01 / llama-cpp-python 0.3.36"
