"""tools/spec/bench_spec_gpu.py (the GPU script's `spec` stage) as a dry run on the CPU: a device call
must not be the first time it runs. The figures come from a lent GPU."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_spec_stage_runs_and_writes_its_table(tmp_path):
    out = tmp_path / "spec.md"
    subprocess.run([sys.executable, str(ROOT / "tools" / "spec" / "bench_spec_gpu.py"), "--device", "cpu",
                    "--model", "tiny-random", "--dtype", "", "--streams", "2", "--max-tokens", "4", "--repeats", "1", "--kv-tokens", "4096",
                    "--out", str(out)], check=True, capture_output=True, timeout=300)
    text = out.read_text()
    assert "| N | workload | off tok/s | on tok/s | ratio | acceptance |" in text
    rows = [line for line in text.splitlines() if line.startswith("| ") and "workload" not in line]
    assert len(rows) == 3  # one N, three workloads
    assert "float32, repeat: 0 of 8 sequences differ" in text and "float32, code: 0 of 8 sequences differ" in text
