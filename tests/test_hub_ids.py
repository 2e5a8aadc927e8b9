"""Hugging Face ids resolve from a local hub cache (built here in tmp, in the hub's own layout), offline."""
import hashlib
import shutil
import sys

import pytest
import torch
from model_families import byte_vocab, hf_model, special_ids, write_gguf, write_hf_folder

from slipstream.errors import ModelNotFoundError
from slipstream.models.loading.hub import cached_snapshot, hf_cache_dir, parse_hf_id
from slipstream.models.loading.loader import load_model, resolve_model_path

REPO = "TinyOrg/Tiny-Qwen2-Instruct"
COMMIT_A, COMMIT_B = "a" * 40, "b" * 40


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny HF folder and GGUF of the same random Qwen2 weights."""
    root = tmp_path_factory.mktemp("ckpt")
    vocab = byte_vocab()
    bos, eos = special_ids(vocab)
    model = hf_model("qwen2", len(vocab.tokens), seed=5, bos=bos, eos=eos)
    write_gguf(root / "tiny.gguf", "qwen2", model, vocab, pre="qwen2")
    write_hf_folder(root / "folder", model, root / "tiny.gguf")
    return root, model


def add_snapshot(cache, repo: str, commit: str, files: dict, ref: str | None = "main"):
    """Lay files out as huggingface_hub does: content-addressed blobs, snapshot symlinks, a ref file."""
    repo_dir = cache / ("models--" + repo.replace("/", "--"))
    snap = repo_dir / "snapshots" / commit
    (repo_dir / "blobs").mkdir(parents=True, exist_ok=True)
    snap.mkdir(parents=True, exist_ok=True)
    for name, src in files.items():
        data = src.read_bytes()
        blob = repo_dir / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snap / name).symlink_to(blob)
    if ref:
        (repo_dir / "refs").mkdir(exist_ok=True)
        (repo_dir / "refs" / ref).write_text(commit)
    return snap


def folder_files(root):
    return {p.name: p for p in (root / "folder").iterdir()}


@pytest.fixture
def hub(tmp_path, monkeypatch, checkpoint):
    cache = tmp_path / "hub"
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    add_snapshot(cache, REPO, COMMIT_A, folder_files(checkpoint[0]))
    return cache


def test_parse_hf_id():
    assert parse_hf_id("HuggingFaceTB/SmolLM2-135M-Instruct") == ("HuggingFaceTB/SmolLM2-135M-Instruct", "main")
    assert parse_hf_id("org/name@v1.0") == ("org/name", "v1.0")
    for not_an_id in ("smollm2-135m", "/abs/path", "a/b/c", "dir/model.gguf", "org/", "./x"):
        assert parse_hf_id(not_an_id) is None, not_an_id


def test_id_loads_from_the_cache_offline(hub, checkpoint):
    loaded = load_model(REPO)
    assert loaded.path == hub / f"models--{REPO.replace('/', '--')}" / "snapshots" / COMMIT_A
    assert loaded.config.name == REPO and loaded.config.architecture == "qwen2"
    theirs = checkpoint[1].state_dict()
    for name, t in loaded.weights.items():
        assert torch.equal(t, theirs[name]), name
    assert loaded.tokenizer.encode("Hello world") == load_model(str(checkpoint[0] / "folder")).tokenizer.encode(
        "Hello world")


def test_revisions(hub, checkpoint):
    repo_dir = hub / f"models--{REPO.replace('/', '--')}"
    add_snapshot(hub, REPO, COMMIT_B, {"tiny.gguf": checkpoint[0] / "tiny.gguf"}, ref="v2")
    assert resolve_model_path(f"{REPO}@v2") == repo_dir / "snapshots" / COMMIT_B / "tiny.gguf"
    assert resolve_model_path(f"{REPO}@{COMMIT_B}") == repo_dir / "snapshots" / COMMIT_B / "tiny.gguf"
    assert resolve_model_path(REPO) == repo_dir / "snapshots" / COMMIT_A  # main still points at A
    assert load_model(f"{REPO}@v2").config.architecture == "qwen2"  # the GGUF in that snapshot loads


def test_cache_location_follows_hf_home_and_xdg(tmp_path, monkeypatch):
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert hf_cache_dir() == tmp_path / "home" / ".cache" / "huggingface" / "hub"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hf_cache_dir() == tmp_path / "xdg" / "huggingface" / "hub"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hfhome"))
    assert hf_cache_dir() == tmp_path / "hfhome" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "explicit"))
    assert hf_cache_dir() == tmp_path / "explicit"


def test_missing_id_names_what_was_looked_for(hub):
    with pytest.raises(ModelNotFoundError) as err:
        load_model("NoSuchOrg/no-such-model")
    msg = str(err.value)
    assert "NoSuchOrg/no-such-model" in msg and str(hub) in msg
    assert "models--NoSuchOrg--no-such-model" in msg and "HF_HUB_OFFLINE" in msg


def test_dangling_ref_and_unloadable_snapshot(hub, tmp_path):
    repo = "TinyOrg/broken"
    repo_dir = hub / "models--TinyOrg--broken"
    (repo_dir / "refs").mkdir(parents=True)
    (repo_dir / "refs" / "main").write_text(COMMIT_A)  # no such snapshot
    assert cached_snapshot(repo, "main", hub) is None
    with pytest.raises(ModelNotFoundError, match="TinyOrg/broken"):
        load_model(repo)
    readme = tmp_path / "README.md"
    readme.write_text("just a readme")
    add_snapshot(hub, repo, COMMIT_A, {"README.md": readme})
    with pytest.raises(ModelNotFoundError, match=r"neither config\.json"):
        load_model(repo)


def test_several_ggufs_are_ambiguous(hub, checkpoint):
    gguf = checkpoint[0] / "tiny.gguf"
    add_snapshot(hub, "TinyOrg/quants", COMMIT_A, {"a-Q4.gguf": gguf, "a-Q8.gguf": gguf})
    with pytest.raises(ModelNotFoundError, match=r"a-Q4\.gguf, a-Q8\.gguf"):
        resolve_model_path("TinyOrg/quants")


def test_existing_local_path_wins(hub, checkpoint, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shutil.copytree(checkpoint[0] / "folder", tmp_path / REPO)
    assert resolve_model_path(REPO).resolve() == (tmp_path / REPO).resolve()  # the local folder, not the cache


def test_download_when_allowed(hub, checkpoint, monkeypatch):
    """With HF_HUB_OFFLINE unset, a cache miss goes to huggingface_hub (faked here: no network)."""
    import huggingface_hub

    monkeypatch.delenv("HF_HUB_OFFLINE")
    calls = []

    def fake_download(repo_id, revision, cache_dir, allow_patterns):
        calls.append((repo_id, revision, allow_patterns))
        from pathlib import Path

        return str(add_snapshot(Path(cache_dir), repo_id, COMMIT_B, folder_files(checkpoint[0])))

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    loaded = load_model("OtherOrg/fresh")
    assert calls[0][:2] == ("OtherOrg/fresh", "main")
    assert "*.safetensors" in calls[0][2] and loaded.config.name == "OtherOrg/fresh"
    load_model("OtherOrg/fresh")  # now cached: no second download
    assert len(calls) == 1

    def unreachable(*args, **kwargs):
        raise OSError("network is unreachable")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", unreachable)
    with pytest.raises(ModelNotFoundError, match="OtherOrg/never.*network is unreachable"):
        load_model("OtherOrg/never")
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # not installed
    with pytest.raises(ModelNotFoundError, match="huggingface_hub is not installed"):
        load_model("OtherOrg/never")
