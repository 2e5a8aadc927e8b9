"""A disk cache of converted GGUF checkpoints: repacked weights + config + tokenizer as one safetensors file.

Converting a GGUF (parsing its vocabulary, repacking or dequantising every tensor) costs seconds on
every start; mapping the converted file back costs milliseconds. An entry holds each weight as the
engine computes with it: a quantized tensor in its repacked container (models/kernels/quant_formats.py:
values, scales, offsets), anything else as float32. One entry serves every dtype and both weight
modes (`EngineConfig.weights`): a dequantized model is expanded from it at load.

Entries live in `$SLIPSTREAM_CACHE_DIR`, else `$XDG_CACHE_HOME/slipstream`, else `~/.cache/slipstream`,
under `weights/`, named by the GGUF's contents (not its path): the same file installed in ten
virtual environments shares one entry. `SLIPSTREAM_WEIGHT_CACHE=0` turns the cache off.

Writes go to a temporary file in the same directory and are renamed into place, so a reader never
sees half an entry. Every entry carries a CRC-32 per tensor; an entry that fails to parse, lacks a
tensor, or fails a checksum is deleted and rebuilt from the GGUF. A hit touches the entry's mtime;
each store removes entries unused for `SLIPSTREAM_WEIGHT_CACHE_DAYS` (default 14) days, then the
least recently used ones while the directory holds more than `SLIPSTREAM_WEIGHT_CACHE_GB` (default
16) GB, and temp files a crashed writer left behind: an entry of a GGUF deleted since (or of an
older slipstream, whose entries this one never reads) does not stay forever.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
import zlib
from dataclasses import asdict
from pathlib import Path
from typing import Any

import structlog
import torch

from slipstream.models.config import ModelConfig
from slipstream.models.kernels.quant_formats import QuantWeight, concat, split
from slipstream.models.tokenizers.tokenizer import Tokenizer

log = structlog.get_logger(__name__)

# Bump when the conversion (names, q/k un-permutation, containers, config fields, tokenizer build)
# changes: entries of another version are never read (their names differ) and age out.
FORMAT_VERSION = "2"
SUFFIX = f".v{FORMAT_VERSION}.safetensors"
_SAMPLES, _SAMPLE_BYTES, _HEADER_BYTES = 16, 64 << 10, 1 << 20
_OFF = {"0", "false", "no", "off"}
_PART = "#"  # "<weight name>#values" etc.: the parts of a QuantWeight
# Projections the CPU forward multiplies at once (models/llama/forward_cpu.py), stored stacked when their
# containers allow: loaded back, the parts are adjacent views of one tensor, which fuse without a copy.
FUSED = ((".self_attn.qkv_proj", (".self_attn.q_proj", ".self_attn.k_proj", ".self_attn.v_proj")),
         (".mlp.gate_up_proj", (".mlp.gate_proj", ".mlp.up_proj")))


def cache_enabled() -> bool:
    return os.environ.get("SLIPSTREAM_WEIGHT_CACHE", "1").strip().lower() not in _OFF


def cache_root() -> Path:
    if os.environ.get("SLIPSTREAM_CACHE_DIR"):
        return Path(os.environ["SLIPSTREAM_CACHE_DIR"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "slipstream"


def source_key(path: Path) -> str:
    """Identity of a GGUF's contents, cheap enough to compute on every start.

    Size + a hash of its first MiB (the header: all metadata, tensor names, types and offsets) and of
    16 samples of 64 KiB spread over the rest, rather than of the whole file (hashing a multi-GB
    checkpoint would itself cost the seconds the cache saves). Neither the path nor the mtime is
    part of it: a copy in another environment is the same entry. A re-quantisation or fine-tune
    changes the header's types or the sampled weights; only an edit confined to unsampled bytes
    would go unnoticed, and the entry holds nothing but data derived from that file.
    """
    size = path.stat().st_size
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{FORMAT_VERSION}|{size}".encode())
    with open(path, "rb") as f:
        h.update(f.read(_HEADER_BYTES))
        for i in range(_SAMPLES):
            f.seek(max(0, (size - _SAMPLE_BYTES) * (i + 1) // _SAMPLES))
            h.update(f.read(_SAMPLE_BYTES))
    return h.hexdigest()


def entry_path(path: Path, root: Path | None = None) -> Path:
    return (root or cache_root()) / "weights" / f"{path.stem}-{source_key(path)}{SUFFIX}"


def _crc(t: torch.Tensor) -> int:
    return zlib.crc32(t.contiguous().view(torch.uint8).numpy().data)


def _stack(weights: dict[str, torch.Tensor | QuantWeight]) -> tuple[dict, dict[str, list]]:
    """`weights` with each FUSED group of QuantWeights replaced by its stacked weight, and the groups'
    parts (name, rows) by stacked name."""
    out, parts = dict(weights), {}
    for name in weights:
        for fused, members in FUSED:
            suffix = members[0] + ".weight"
            if not name.endswith(suffix):
                continue
            prefix = name[: -len(suffix)]
            names = [f"{prefix}{m}.weight" for m in members]
            ws: list[Any] = [weights.get(n) for n in names]
            stacked = concat(ws) if all(isinstance(w, QuantWeight) for w in ws) else None
            if stacked is not None:
                for n in names:
                    del out[n]
                out[f"{prefix}{fused}.weight"] = stacked
                parts[f"{prefix}{fused}.weight"] = [[n, w.rows] for n, w in zip(names, ws)]
    return out, parts


def _flatten(weights: dict[str, torch.Tensor | QuantWeight]) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
    """Plain tensors by name, and each QuantWeight's description (its parts go under name#part)."""
    stacked, members = _stack(weights)
    flat, quant = {}, {}
    for name, w in stacked.items():
        if isinstance(w, QuantWeight):
            quant[name] = {"kind": w.kind, "group": w.group, "source": w.source, "rows": w.rows, "cols": w.cols,
                           "parts": members.get(name)}
            for part, t in w.tensors().items():
                flat[f"{name}{_PART}{part}"] = t
        else:
            flat[name] = w
    return flat, quant


def _assemble(flat: dict[str, torch.Tensor], quant: dict[str, dict]) -> dict[str, torch.Tensor | QuantWeight]:
    weights: dict[str, torch.Tensor | QuantWeight] = {k: v for k, v in flat.items() if _PART not in k}
    for name, d in quant.items():
        w = QuantWeight(d["kind"], flat[f"{name}{_PART}values"], flat[f"{name}{_PART}scales"],
                        flat.get(f"{name}{_PART}offsets"), int(d["group"]), d["source"], int(d["rows"]),
                        int(d["cols"]))
        if d.get("parts"):  # a stacked group: its members, as views
            for (member, _), view in zip(d["parts"], split(w, [int(r) for _, r in d["parts"]])):
                weights[member] = view
        else:
            weights[name] = w
    return weights


def _read(entry: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The entry's tensors, backed by its file mapping, and its metadata."""
    from safetensors import safe_open

    with safe_open(str(entry), framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}, (f.metadata() or {})


def load_entry(entry: Path) -> tuple[ModelConfig, dict[str, torch.Tensor | QuantWeight], Tokenizer] | None:
    """The cached (config, weights, tokenizer), or None when absent; a damaged entry is deleted.

    The checksums read every page of the entry; those pages are handed back to the kernel right after
    (they stay in the page cache), so the process's resident memory grows only as the model reads its
    weights, not by a full copy at load."""
    if not entry.is_file():
        return None
    from slipstream.models.kernels.cpu_linear import file_mappings, release_file_pages

    start = time.perf_counter()
    try:
        flat, meta = _read(entry)
        crcs = json.loads(meta["crc32"])
        if meta.get("format") != FORMAT_VERSION or set(crcs) != set(flat):
            raise ValueError("tensor list does not match the recorded checksums")
        mappings = file_mappings()
        for name, t in flat.items():
            if _crc(t) != crcs[name]:
                raise ValueError(f"tensor {name!r} fails its checksum")
            release_file_pages(t, mappings)
        weights = _assemble(flat, json.loads(meta["quant"]))
        cfg = json.loads(meta["config"])
        fields: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in cfg.items()}
        config = ModelConfig(**fields)
        tok = json.loads(meta["tokenizer"])
        tokenizer = Tokenizer.from_json(tok["backend"], bos_token_id=tok["bos"], eos_token_ids=tok["eos"],
                                        chat_template=tok["chat_template"])
    except Exception as exc:  # any damage at all means "rebuild": the GGUF is the source of truth
        log.warning("weight_cache_corrupt", path=str(entry), error=f"{type(exc).__name__}: {exc}")
        try:
            entry.unlink(missing_ok=True)
        except OSError:  # a read-only cache: the rebuilt entry's store will log why it cannot write
            pass
        return None
    try:
        os.utime(entry)  # last use, for pruning
    except OSError:
        pass
    log.info("weight_cache_hit", path=str(entry), tensors=len(weights), seconds=round(time.perf_counter() - start, 2))
    return config, weights, tokenizer


def store_entry(entry: Path, config: ModelConfig, weights: dict[str, torch.Tensor | QuantWeight],
                tokenizer: Tokenizer) -> None:
    """Write atomically (temp file + rename), then prune the cache; a failure (read-only dir, full
    disk) only logs."""
    from safetensors.torch import save_file

    flat, quant = _flatten(weights)
    meta = {
        "format": FORMAT_VERSION,
        "config": json.dumps(asdict(config)),
        "tokenizer": json.dumps({"backend": tokenizer.backend.to_str(), "bos": tokenizer.bos_token_id,
                                 "eos": list(tokenizer.eos_token_ids), "chat_template": tokenizer.chat_template}),
        "crc32": json.dumps({name: _crc(t) for name, t in flat.items()}),
        "quant": json.dumps(quant),
    }
    tmp = None
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=entry.parent, prefix=entry.name + ".", suffix=".tmp")
        os.close(fd)
        save_file({k: v.contiguous() for k, v in flat.items()}, tmp, metadata=meta)
        os.chmod(tmp, 0o644)  # mkstemp makes it owner-only; a cache of public weights need not be
        os.replace(tmp, entry)
        tmp = None
        log.info("weight_cache_stored", path=str(entry), size_bytes=entry.stat().st_size)
        prune(entry.parent, keep=entry)
    except OSError as exc:
        log.warning("weight_cache_store_failed", path=str(entry), error=str(exc))
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


def _limits() -> tuple[float, float]:
    days = float(os.environ.get("SLIPSTREAM_WEIGHT_CACHE_DAYS", "14"))
    gb = float(os.environ.get("SLIPSTREAM_WEIGHT_CACHE_GB", "16"))
    return days * 86400, gb * 1e9


def prune(folder: Path, keep: Path | None = None) -> list[Path]:
    """Delete temp files older than an hour, entries unused for longer than the age limit, then the
    least recently used entries beyond the size limit (never `keep`). Returns what was deleted."""
    max_age, max_bytes = _limits()
    now, entries, removed = time.time(), [], []
    for p in folder.iterdir():
        try:  # another process may be renaming or pruning the same files
            st = p.stat()
            if p.name.endswith(".tmp"):
                if now - st.st_mtime > 3600:
                    p.unlink(missing_ok=True)
                    removed.append(p)
            elif p.name.endswith(".safetensors") and p != keep:
                if now - st.st_mtime > max_age:
                    p.unlink(missing_ok=True)
                    removed.append(p)
                else:
                    entries.append((st.st_mtime, st.st_size, p))
        except OSError:
            continue
    total = sum(size for _, size, _ in entries) + (keep.stat().st_size if keep is not None and keep.exists() else 0)
    for _, size, p in sorted(entries):  # oldest use first
        if total <= max_bytes:
            break
        try:
            p.unlink(missing_ok=True)
            removed.append(p)
            total -= size
        except OSError:
            continue
    if removed:
        log.info("weight_cache_pruned", removed=[p.name for p in removed])
    return removed


def reopen_mapped(entry: Path, weights: dict[str, torch.Tensor | QuantWeight]) -> dict[str, torch.Tensor | QuantWeight]:
    """The entry just stored, as tensors backed by its file mapping, in place of `weights`.

    Right after a first start's conversion the weights sit in anonymous memory; served from the
    file instead, pages nobody reads can be released, as on a hit. `weights` is returned unchanged if
    the entry cannot be read back or differs from it in names, shapes or dtypes."""
    try:
        flat, meta = _read(entry)
        mapped = _assemble(flat, json.loads(meta["quant"]))
    except Exception as exc:  # noqa: BLE001 - the in-memory weights are as good, only larger
        log.warning("weight_cache_reopen_failed", path=str(entry), error=f"{type(exc).__name__}: {exc}")
        return weights
    same = mapped.keys() == weights.keys() and all(
        _shape(mapped[n]) == _shape(w) for n, w in weights.items())
    return mapped if same else weights


def _shape(w: torch.Tensor | QuantWeight) -> tuple:
    if isinstance(w, QuantWeight):
        return (w.kind, w.shape, w.group, w.scales.dtype, w.values.shape)
    return (tuple(w.shape), w.dtype)
