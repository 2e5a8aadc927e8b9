"""Provenance headers of raw benchmark outputs (slipstream/provenance.py)."""
from __future__ import annotations

import json
import subprocess

from slipstream import provenance as prov_mod


def test_header_records_command_commit_dirty_flag_versions_and_date():
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=prov_mod.REPO, capture_output=True,
                          text=True).stdout.strip()
    p = prov_mod.provenance(["python", "tools/x.py", "--n", "1 2"], extra={"llama.cpp": "abc123"})
    assert p["command"] == "python tools/x.py --n '1 2'"
    assert p["git"]["commit"] == head and p["git"]["dirty"] in (True, False) and p["git"]["source"] == "git"
    assert p["date_utc"].endswith("+00:00") and "torch" in p["versions"] and "python" in p["versions"]
    text = prov_mod.header(p)
    for needle in ("- command: `python tools/x.py", f"- git: {head}", "- versions: python ", "torch ",
                   "- date (UTC): ", "- llama.cpp: abc123", "- machine: "):
        assert needle in text, needle
    assert ("(dirty, diff " in text) == p["git"]["dirty"]


def test_a_copy_without_git_reads_the_stamp_and_says_so(tmp_path):
    stamp = tmp_path / "provenance-git.json"
    assert prov_mod.git_info(repo=tmp_path, stamp=stamp)["commit"] == "unknown"  # never a guessed commit
    stamp.write_text(json.dumps({"commit": "f" * 40, "dirty": True, "diff_sha256": "00ff"}))
    info = prov_mod.git_info(repo=tmp_path, stamp=stamp)
    assert info["commit"] == "f" * 40 and info["dirty"] is True and info["source"].startswith("stamp")
