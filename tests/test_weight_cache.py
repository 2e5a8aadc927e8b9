"""The converted-GGUF cache: hits skip dequantisation, damaged entries are rebuilt, keys follow the file."""
import os

import pytest
import torch
from model_families import byte_vocab, hf_model, special_ids, write_gguf
from structlog.testing import capture_logs

from slipstream.models import gguf_loader, loader
from slipstream.models.loader import load_model
from slipstream.models.weight_cache import cache_root, entry_path


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    root = tmp_path_factory.mktemp("wc")
    vocab = byte_vocab()
    bos, eos = special_ids(vocab)
    write_gguf(root / "tiny.gguf", "qwen2", hf_model("qwen2", len(vocab.tokens), seed=7, bos=bos, eos=eos), vocab,
               pre="qwen2")
    return root / "tiny.gguf"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SLIPSTREAM_WEIGHT_CACHE", "1")
    monkeypatch.setenv("SLIPSTREAM_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def events(logs):
    return [e["event"] for e in logs]


def load_counting(path, monkeypatch):
    """load_model, returning (loaded, whether the GGUF was dequantised)."""
    calls = []
    real = gguf_loader.load_gguf

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(loader, "load_gguf", counting)
    return load_model(str(path)), bool(calls)


def assert_same(a, b):
    assert a.config == b.config
    assert set(a.weights) == set(b.weights)
    for name in a.weights:
        assert torch.equal(a.weights[name], b.weights[name]), name
    for text in ("Hello world! 12345", "<|im_start|>hi<|im_end|>", "🤖"):
        assert a.tokenizer.encode(text) == b.tokenizer.encode(text)
    assert a.tokenizer.eos_token_ids == b.tokenizer.eos_token_ids
    assert a.tokenizer.bos_token_id == b.tokenizer.bos_token_id
    assert a.tokenizer.chat_template == b.tokenizer.chat_template


def test_second_load_is_a_hit_and_identical(gguf_file, cache, monkeypatch):
    first, converted = load_counting(gguf_file, monkeypatch)
    assert converted
    entry = entry_path(gguf_file, torch.float32)
    assert entry.parent == cache / "weights" and entry.is_file()
    assert [p.name for p in entry.parent.iterdir()] == [entry.name]  # no temp file left behind
    with capture_logs() as logs:
        second, converted = load_counting(gguf_file, monkeypatch)
    assert not converted and events(logs) == ["weight_cache_hit"]
    assert_same(first, second)


@pytest.mark.parametrize("damage", ["truncate", "flip", "garbage", "empty"])
def test_damaged_entry_is_detected_and_rebuilt(gguf_file, cache, monkeypatch, damage):
    good, _ = load_counting(gguf_file, monkeypatch)
    entry = entry_path(gguf_file, torch.float32)
    data = bytearray(entry.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "flip":
        data[-10] ^= 0x01  # inside the last tensor's data: only the checksum can tell
    elif damage == "garbage":
        data = bytearray(os.urandom(4096))
    else:
        data = bytearray()
    # A new file in its place, as a later start would find it: `good` still maps the old one (an
    # in-place truncation under a live mapping would kill this process with SIGBUS, hit or not).
    damaged = entry.with_name(entry.name + ".damaged")
    damaged.write_bytes(bytes(data))
    os.replace(damaged, entry)
    with capture_logs() as logs:
        rebuilt, converted = load_counting(gguf_file, monkeypatch)
    assert converted and "weight_cache_corrupt" in events(logs) and "weight_cache_stored" in events(logs)
    assert_same(good, rebuilt)
    _, converted = load_counting(gguf_file, monkeypatch)
    assert not converted  # the rebuilt entry is good again


def test_key_follows_the_file_and_dtype(gguf_file, cache, tmp_path):
    copy = tmp_path / "tiny.gguf"
    copy.write_bytes(gguf_file.read_bytes())
    key32 = entry_path(copy, torch.float32)
    assert entry_path(copy, torch.bfloat16) != key32
    st = copy.stat()
    os.utime(copy, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert entry_path(copy, torch.float32) != key32  # rewritten (new mtime): a new entry
    os.utime(copy, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert entry_path(copy, torch.float32) == key32
    data = bytearray(copy.read_bytes())
    data[100] ^= 0xFF  # same size, same mtime, different header bytes
    copy.write_bytes(bytes(data))
    os.utime(copy, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert entry_path(copy, torch.float32) != key32


def test_bfloat16_entries(gguf_file, cache, monkeypatch):
    a = loader.load_model(str(gguf_file), dtype=torch.bfloat16)
    b, converted = load_counting(gguf_file, monkeypatch)  # float32: its own entry, converted afresh
    assert converted
    c = loader.load_model(str(gguf_file), dtype=torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in c.weights.values())
    assert_same(a, c)
    assert len(list((cache / "weights").iterdir())) == 2


def test_disabled_and_default_location(gguf_file, tmp_path, monkeypatch):
    monkeypatch.setenv("SLIPSTREAM_WEIGHT_CACHE", "0")
    monkeypatch.setenv("SLIPSTREAM_CACHE_DIR", str(tmp_path / "off"))
    load_model(str(gguf_file))
    assert not (tmp_path / "off").exists()
    monkeypatch.delenv("SLIPSTREAM_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "slipstream"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == tmp_path / "home" / ".cache" / "slipstream"


def test_unwritable_cache_only_warns(gguf_file, tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the cache directory should be")
    monkeypatch.setenv("SLIPSTREAM_WEIGHT_CACHE", "1")
    monkeypatch.setenv("SLIPSTREAM_CACHE_DIR", str(blocker))
    with capture_logs() as logs:
        loaded = load_model(str(gguf_file))
    assert loaded.config.architecture == "qwen2" and "weight_cache_store_failed" in events(logs)


def test_generate_no_weight_cache_flag(gguf_file, cache, monkeypatch, capsys):
    import argparse

    from slipstream.commands import generate

    def main(argv):  # the CLI minus slipstream.cli.main's logging setup, which would outlive this test
        parser = argparse.ArgumentParser()
        generate.register(parser.add_subparsers())
        args = parser.parse_args(argv)
        return args.func(args)

    argv = ["generate", "Hello", "--raw", "--max-tokens", "2", "--model", str(gguf_file)]
    from slipstream.models.build import forget_loaded

    forget_loaded()  # engines in one process share a load; this test needs two
    assert main(argv + ["--no-weight-cache"]) == 0
    assert not cache.exists()
    monkeypatch.setenv("SLIPSTREAM_WEIGHT_CACHE", "1")  # the flag sets it to 0 for the rest of the process
    forget_loaded()
    assert main(argv) == 0  # without the flag the same run fills the cache
    forget_loaded()
    assert len(list((cache / "weights").iterdir())) == 1


def test_outdated_entries_and_stale_temp_files_are_pruned(gguf_file, cache, tmp_path, monkeypatch):
    here, there = tmp_path / "a" / "tiny.gguf", tmp_path / "b" / "tiny.gguf"  # same name, two places
    for p in (here, there):
        p.parent.mkdir()
        p.write_bytes(gguf_file.read_bytes())
    load_model(str(here))
    load_model(str(there))
    weights = cache / "weights"
    assert len(list(weights.iterdir())) == 2  # one per file: a shared name does not evict
    old_entry = entry_path(here, torch.float32)
    stale, fresh = weights / (old_entry.name + ".x.tmp"), weights / (old_entry.name + ".y.tmp")
    stale.write_bytes(b"half")
    fresh.write_bytes(b"half")
    os.utime(stale, (0, 0))  # a crashed writer, long ago; `fresh` may be a writer at work now
    st = here.stat()
    os.utime(here, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # "re-downloaded"
    load_model(str(here))
    names = {p.name for p in weights.iterdir()}
    assert entry_path(here, torch.float32).name in names and old_entry.name not in names
    assert entry_path(there, torch.float32).name in names
    assert fresh.name in names and stale.name not in names
