"""Provenance headers of raw benchmark outputs (slipstream/provenance.py)."""
from __future__ import annotations

import json
import subprocess

from slipstream import provenance as prov_mod


def test_header_records_command_commit_dirty_flag_versions_and_date(monkeypatch, tmp_path):
    monkeypatch.setattr(prov_mod, "STAMP", tmp_path / "none.json")  # (a stamp left in .whl/ would win)
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


def _one_commit_repo(path):
    """A git repository in `path` with a.txt committed ("one")."""
    def git(*args):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=path, check=True,
                       capture_output=True)

    git("init", "-q")
    (path / "a.txt").write_text("one\n")
    git("add", "a.txt")
    git("commit", "-qm", "one")


def test_dirty_flag_and_diff_hash_follow_the_tree(tmp_path):
    _one_commit_repo(tmp_path)
    clean = prov_mod.git_state(tmp_path)
    assert clean["dirty"] is False and clean["diff_sha256"] is None and len(clean["commit"]) == 40
    (tmp_path / "a.txt").write_text("two\n")
    dirty = prov_mod.git_state(tmp_path)
    assert dirty["dirty"] is True and dirty["diff_sha256"] and dirty["commit"] == clean["commit"]
    (tmp_path / "b.txt").write_text("untracked\n")  # untracked files do not make a run dirty
    (tmp_path / "a.txt").write_text("one\n")
    assert prov_mod.git_state(tmp_path)["dirty"] is False


def test_a_copy_inside_another_work_tree_reads_the_stamp_not_the_enclosing_head(tmp_path):
    """The GPU machine's copy sat in another checkout: its HEAD (75da0d1) was printed as ours."""
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty", "-m", "x"],
                   cwd=tmp_path, check=True)
    copy = tmp_path / "project"
    copy.mkdir()
    stamp = copy / ".whl" / "provenance-git.json"
    assert prov_mod.git_state(copy) is None
    assert prov_mod.git_info(repo=copy, stamp=stamp)["commit"] == "unknown"
    stamp.parent.mkdir()
    stamp.write_text(json.dumps({"commit": "a" * 40, "dirty": False, "diff_sha256": None}))
    info = prov_mod.git_info(repo=copy, stamp=stamp)
    assert info["commit"] == "a" * 40 and info["source"].startswith("stamp")
    assert prov_mod.git_state(tmp_path)["commit"] != "a" * 40  # the enclosing checkout still answers for itself


def test_the_stamp_wins_over_a_copy_that_carries_its_own_repository(tmp_path):
    """2026-11-27, H200: the copy sent there carried a git repository at the session's first commit
    (99596d0) plus a diff, and the header said `99596d0 (dirty)` for a run of e8fbc7a."""
    _one_commit_repo(tmp_path)
    (tmp_path / "a.txt").write_text("two\n")
    own = prov_mod.git_state(tmp_path)
    assert own["dirty"] is True
    stamp = tmp_path / ".whl" / "provenance-git.json"
    assert prov_mod.git_info(repo=tmp_path, stamp=stamp) == own  # no stamp: git answers
    stamp.parent.mkdir()
    stamp.write_text(json.dumps({"commit": "e" * 40, "dirty": False, "diff_sha256": None,
                                 "stamp_written_utc": "2026-11-27T12:40:00+00:00"}))
    info = prov_mod.git_info(repo=tmp_path, stamp=stamp)
    assert info["commit"] == "e" * 40 and info["dirty"] is False and info["source"].startswith("stamp")
    assert f"git here says {own['commit'][:12]} (dirty), not used" in info["source"]
    text = prov_mod.header({**prov_mod.provenance("x"), "git": info})
    assert f"- git: {'e' * 40} (clean) [stamp" in text
    stamp.write_text(json.dumps({k: own[k] for k in ("commit", "dirty", "diff_sha256")}))
    assert "not used" not in prov_mod.git_info(repo=tmp_path, stamp=stamp)["source"]  # agreeing: no note
