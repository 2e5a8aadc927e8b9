"""The converted-GGUF cache: hits skip conversion, damaged entries are rebuilt, keys follow the contents
(not the path), quantized weights stay quantized in it, and unused entries are pruned."""
import os
import time

import gguf
import pytest
import torch
from model_families import byte_vocab, hf_model, special_ids, write_gguf
from structlog.testing import capture_logs

from slipstream.models.loading import gguf_loader, loader
from slipstream.models.loading.loader import load_model
from slipstream.models.kernels.quant_formats import QuantWeight, concat
from slipstream.models.loading.weight_cache import cache_root, entry_path, prune

Q = gguf.GGMLQuantizationType


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    """A tiny qwen2 GGUF with quantized projections and embedding (q/k/v, gate/up stack in the cache)."""
    root = tmp_path_factory.mktemp("wc")
    vocab = byte_vocab()
    bos, eos = special_ids(vocab)
    quantize = {"token_embd.weight": Q.Q8_0}
    for i in range(2):
        quantize.update({f"blk.{i}.attn_q.weight": Q.Q4_1, f"blk.{i}.attn_k.weight": Q.Q4_1,
                         f"blk.{i}.attn_v.weight": Q.Q4_1, f"blk.{i}.ffn_gate.weight": Q.Q4_0,
                         f"blk.{i}.ffn_up.weight": Q.Q4_0, f"blk.{i}.ffn_down.weight": Q.Q8_0})
    write_gguf(root / "tiny.gguf", "qwen2", hf_model("qwen2", len(vocab.tokens), seed=7, bos=bos, eos=eos), vocab,
               pre="qwen2", quantize=quantize)
    return root / "tiny.gguf"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SLIPSTREAM_WEIGHT_CACHE", "1")
    monkeypatch.setenv("SLIPSTREAM_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def events(logs):
    return [e["event"] for e in logs]


def load_counting(path, monkeypatch, weights="dequantized"):
    """load_model, returning (loaded, whether the GGUF was converted)."""
    calls = []
    real = gguf_loader.load_gguf

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(loader, "load_gguf", counting)
    return load_model(str(path), weights=weights), bool(calls)


def same_weight(a, b) -> bool:
    if isinstance(a, QuantWeight):
        return isinstance(b, QuantWeight) and all(torch.equal(x, y) for x, y in zip(a.tensors().values(),
                                                                                    b.tensors().values()))
    return torch.equal(a, b)


def assert_same(a, b):
    assert a.config == b.config
    assert set(a.weights) == set(b.weights)
    for name in a.weights:
        assert same_weight(a.weights[name], b.weights[name]), name
    for text in ("Hello world! 12345", "<|im_start|>hi<|im_end|>", "🤖"):
        assert a.tokenizer.encode(text) == b.tokenizer.encode(text)
    assert a.tokenizer.eos_token_ids == b.tokenizer.eos_token_ids
    assert a.tokenizer.bos_token_id == b.tokenizer.bos_token_id
    assert a.tokenizer.chat_template == b.tokenizer.chat_template


def test_second_load_is_a_hit_and_identical(gguf_file, cache, monkeypatch):
    first, converted = load_counting(gguf_file, monkeypatch)
    assert converted
    entry = entry_path(gguf_file)
    assert entry.parent == cache / "weights" and entry.is_file()
    assert [p.name for p in entry.parent.iterdir()] == [entry.name]  # no temp file left behind
    with capture_logs() as logs:
        second, converted = load_counting(gguf_file, monkeypatch)
    assert not converted and events(logs) == ["weight_cache_hit"]
    assert_same(first, second)
    fresh = gguf_loader.load_gguf(gguf_file)[1]  # what the GGUF dequantises to, no cache involved
    assert all(torch.equal(fresh[n], second.weights[n]) for n in fresh)


def test_quantized_weights_stay_quantized_and_stacked(gguf_file, cache, monkeypatch):
    """The entry holds the quantized containers (a fifth of float32's size here), and the projections
    stored stacked come back as adjacent views: fusing them copies nothing."""
    dense, _ = load_counting(gguf_file, monkeypatch)
    quant, converted = load_counting(gguf_file, monkeypatch, weights="quantized")
    assert not converted  # one entry serves both weight modes
    q = quant.weights
    assert isinstance(q["model.embed_tokens.weight"], QuantWeight) and q["model.embed_tokens.weight"].source == "Q8_0"
    assert isinstance(q["model.layers.0.mlp.down_proj.weight"], QuantWeight)
    assert isinstance(q["model.norm.weight"], torch.Tensor)
    for name, w in q.items():
        expect = dense.weights[name]
        assert torch.equal(w.dequantize() if isinstance(w, QuantWeight) else w, expect), name
    parts = [q[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"]
    fused = concat(parts)
    assert fused.values.data_ptr() == parts[0].values.data_ptr()  # a view, not a copy
    assert torch.equal(fused.dequantize(), torch.cat([p.dequantize() for p in parts]))
    dense_bytes = sum(t.numel() * 4 for t in dense.weights.values())
    assert entry_path(gguf_file).stat().st_size < dense_bytes / 2


@pytest.mark.parametrize("damage", ["truncate", "flip", "garbage", "empty"])
def test_damaged_entry_is_detected_and_rebuilt(gguf_file, cache, monkeypatch, damage):
    good, _ = load_counting(gguf_file, monkeypatch)
    entry = entry_path(gguf_file)
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


def test_key_follows_the_contents_not_the_path(gguf_file, cache, tmp_path, monkeypatch):
    """A copy elsewhere (another venv's install, re-downloaded with a new mtime) is the same entry;
    a change inside the file is a new one."""
    copy = tmp_path / "elsewhere" / "tiny.gguf"
    copy.parent.mkdir()
    copy.write_bytes(gguf_file.read_bytes())
    key = entry_path(gguf_file)
    assert entry_path(copy) == key
    st = copy.stat()
    os.utime(copy, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert entry_path(copy) == key
    load_model(str(gguf_file))
    load_model(str(copy))
    assert len(list((cache / "weights").iterdir())) == 1
    data = bytearray(copy.read_bytes())
    data[100] ^= 0xFF  # same size, different header bytes
    copy.write_bytes(bytes(data))
    assert entry_path(copy) != key


def test_one_entry_for_every_dtype(gguf_file, cache, monkeypatch):
    a = loader.load_model(str(gguf_file), dtype=torch.bfloat16)
    b, converted = load_counting(gguf_file, monkeypatch)
    assert not converted
    assert all(t.dtype == torch.bfloat16 for t in a.weights.values())
    assert all(t.dtype == torch.float32 for t in b.weights.values())
    assert all(torch.equal(a.weights[n], b.weights[n].bfloat16()) for n in a.weights)
    assert len(list((cache / "weights").iterdir())) == 1


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
    from slipstream.models.llama.build import forget_loaded

    forget_loaded()  # engines in one process share a load; this test needs two
    assert main(argv + ["--no-weight-cache"]) == 0
    assert not (cache / "weights").exists()
    monkeypatch.setenv("SLIPSTREAM_WEIGHT_CACHE", "1")  # the flag sets it to 0 for the rest of the process
    forget_loaded()
    assert main(argv) == 0  # without the flag the same run fills the cache
    forget_loaded()
    assert len(list((cache / "weights").iterdir())) == 1


def test_unused_entries_and_stale_temp_files_are_pruned(gguf_file, cache, monkeypatch):
    """Entries unused for the age limit go (a GGUF deleted since, an older slipstream's format), then
    the least recently used beyond the size limit; the entry being stored, recent temp files (a
    writer at work) and recently used entries stay."""
    load_model(str(gguf_file))
    weights = cache / "weights"
    entry = entry_path(gguf_file)
    old_format = weights / "tiny-0123456789abcdef-a7b8120f-float32.safetensors"  # a format-1 entry
    unused, recent = weights / "gone-1111.v2.safetensors", weights / "kept-2222.v2.safetensors"
    stale, fresh = weights / (entry.name + ".x.tmp"), weights / (entry.name + ".y.tmp")
    for p in (old_format, unused, recent, stale, fresh):
        p.write_bytes(b"x" * 1000)
    month_ago = time.time() - 30 * 86400
    for p in (old_format, unused, stale):
        os.utime(p, (month_ago, month_ago))
    monkeypatch.setenv("SLIPSTREAM_WEIGHT_CACHE_DAYS", "14")
    removed = prune(weights, keep=entry)
    assert {p.name for p in removed} == {old_format.name, unused.name, stale.name}
    assert {p.name for p in weights.iterdir()} == {entry.name, recent.name, fresh.name}
    monkeypatch.setenv("SLIPSTREAM_WEIGHT_CACHE_GB", str(entry.stat().st_size / 1e9))  # room for `keep` only
    assert prune(weights, keep=entry) == [recent]
    os.utime(entry, (month_ago, month_ago))
    load_model(str(gguf_file))  # a hit marks the entry used again
    assert time.time() - entry.stat().st_mtime < 3600


def resident_kb(path) -> int:
    """This process's resident memory in mappings of `path` (/proc/self/smaps)."""
    total, current = 0, None
    with open("/proc/self/smaps") as f:
        for line in f:
            parts = line.split()
            if "-" in parts[0] and len(parts) >= 5:
                current = parts[5] if len(parts) > 5 else None
            elif parts[0] == "Rss:" and current == str(path):
                total += int(parts[1])
    return total


def test_a_hit_reads_the_entry_but_keeps_little_of_it_resident(gguf_file, tmp_path):
    """The checksums touch every page; they are handed back at once, so a load does not hold the
    weights resident before a forward reads them (what keeps RSS after loading low)."""
    from quant_util import random_weight

    from slipstream.models.loading.weight_cache import load_entry, store_entry

    config, weights, tokenizer = gguf_loader.load_gguf(gguf_file, quantized=True)
    weights["extra.weight"] = random_weight("Q8_0", 1024, 1024)  # 1 MB: whole pages to hand back
    weights["extra.bias"] = torch.randn(256 * 1024)
    entry = tmp_path / "entry.v2.safetensors"
    store_entry(entry, config, weights, tokenizer)
    _, loaded, _ = load_entry(entry)
    size_kb = entry.stat().st_size / 1024
    assert resident_kb(entry) < size_kb / 4  # tensor edges and the header stay
    for w in loaded.values():  # and the data is all there
        (w.dequantize() if isinstance(w, QuantWeight) else w).sum()
    assert resident_kb(entry) > size_kb * 3 / 4
