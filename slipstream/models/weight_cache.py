"""A disk cache of converted GGUF checkpoints: dequantised weights + config + tokenizer as one safetensors file.

Dequantising a GGUF costs seconds on every start; reading the same floats back from safetensors costs
a fraction of that. Entries live in `$SLIPSTREAM_CACHE_DIR`, else `$XDG_CACHE_HOME/slipstream`, else
`~/.cache/slipstream`, under `weights/`. `SLIPSTREAM_WEIGHT_CACHE=0` turns the cache off.

Writes go to a temporary file in the same directory and are renamed into place, so a reader never
sees half an entry. Every entry carries a CRC-32 per tensor (CRC-32 runs at several GB/s, so checking
a 500 MB entry costs well under a second); an entry that fails to parse, lacks a tensor, or fails a
checksum is deleted and rebuilt from the GGUF.
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

import structlog
import torch

from slipstream.models.config import ModelConfig
from slipstream.models.tokenizer import Tokenizer

log = structlog.get_logger(__name__)

# Bump when the conversion (names, q/k un-permutation, config fields, tokenizer build) changes, so
# entries written by an older slipstream are never read as current.
FORMAT_VERSION = "1"
_SAMPLE = 1 << 20
_OFF = {"0", "false", "no", "off"}


def cache_enabled() -> bool:
    return os.environ.get("SLIPSTREAM_WEIGHT_CACHE", "1").strip().lower() not in _OFF


def cache_root() -> Path:
    if os.environ.get("SLIPSTREAM_CACHE_DIR"):
        return Path(os.environ["SLIPSTREAM_CACHE_DIR"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "slipstream"


def source_key(path: Path, dtype: torch.dtype) -> str:
    """Identity of a GGUF's contents, cheap enough to compute on every start.

    Size + mtime (ns) + a hash of three 1 MiB samples (start, middle, end) rather than a hash of the
    whole file: hashing a multi-GB checkpoint would itself cost the seconds the cache saves. Any
    rewrite by a download or a copy changes the mtime (or the size, or the sampled header, which holds
    all metadata and tensor offsets); only a deliberate same-size edit with the mtime forged back
    would go unnoticed, and the cache holds nothing but data derived from that file.
    """
    st = path.stat()
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{FORMAT_VERSION}|{st.st_size}|{st.st_mtime_ns}|{dtype}".encode())
    with open(path, "rb") as f:
        for offset in (0, max(0, st.st_size // 2 - _SAMPLE // 2), max(0, st.st_size - _SAMPLE)):
            f.seek(offset)
            h.update(f.read(_SAMPLE))
    return h.hexdigest()


def _entry_prefix(path: Path) -> str:
    """File stem + a hash of its absolute path: the entries of one GGUF, whatever its contents."""
    where = hashlib.blake2b(str(path.resolve()).encode(), digest_size=4).hexdigest()
    return f"{path.stem}-{where}-"


def entry_path(path: Path, dtype: torch.dtype, root: Path | None = None) -> Path:
    dname = str(dtype).removeprefix("torch.")
    return (root or cache_root()) / "weights" / f"{_entry_prefix(path)}{source_key(path, dtype)}-{dname}.safetensors"


def _prune(entry: Path, source: Path) -> None:
    """Drop entries of the same GGUF path and dtype made from older contents (a re-download or an
    edit), and temp files a crashed writer left behind, so the cache does not grow without bound."""
    dsuffix = entry.name.rsplit("-", 1)[1]
    for old in entry.parent.glob(_entry_prefix(source) + "*"):
        try:  # another process may be renaming or pruning the same files
            stale_tmp = old.name.endswith(".tmp") and time.time() - old.stat().st_mtime > 3600
            if old != entry and (stale_tmp or old.name.endswith("-" + dsuffix)):
                old.unlink(missing_ok=True)
        except OSError:
            continue


def _crc(t: torch.Tensor) -> int:
    return zlib.crc32(t.contiguous().view(torch.uint8).numpy())


def load_entry(entry: Path, dtype: torch.dtype) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer] | None:
    """The cached (config, weights, tokenizer), or None when absent; a damaged entry is deleted."""
    if not entry.is_file():
        return None
    from safetensors import safe_open

    start = time.perf_counter()
    try:
        weights: dict[str, torch.Tensor] = {}
        with safe_open(str(entry), framework="pt") as f:
            meta = f.metadata() or {}
            crcs = json.loads(meta["crc32"])
            for name in f.keys():
                weights[name] = f.get_tensor(name)
        if set(crcs) != set(weights):
            raise ValueError("tensor list does not match the recorded checksums")
        for name, t in weights.items():
            if t.dtype != dtype or _crc(t) != crcs[name]:
                raise ValueError(f"tensor {name!r} fails its checksum")
        cfg = json.loads(meta["config"])
        config = ModelConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in cfg.items()})
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
    log.info("weight_cache_hit", path=str(entry), tensors=len(weights), seconds=round(time.perf_counter() - start, 2))
    return config, weights, tokenizer


def store_entry(entry: Path, config: ModelConfig, weights: dict[str, torch.Tensor], tokenizer: Tokenizer,
                source: Path | None = None) -> None:
    """Write atomically (temp file + rename), then prune `source`'s outdated entries; a failure
    (read-only dir, full disk) only logs."""
    from safetensors.torch import save_file

    meta = {
        "format": FORMAT_VERSION,
        "config": json.dumps(asdict(config)),
        "tokenizer": json.dumps({"backend": tokenizer.backend.to_str(), "bos": tokenizer.bos_token_id,
                                 "eos": list(tokenizer.eos_token_ids), "chat_template": tokenizer.chat_template}),
        "crc32": json.dumps({name: _crc(t) for name, t in weights.items()}),
    }
    tmp = None
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=entry.parent, prefix=entry.name + ".", suffix=".tmp")
        os.close(fd)
        save_file({k: v.contiguous() for k, v in weights.items()}, tmp, metadata=meta)
        os.chmod(tmp, 0o644)  # mkstemp makes it owner-only; a cache of public weights need not be
        os.replace(tmp, entry)
        tmp = None
        if source is not None:
            _prune(entry, source)
        log.info("weight_cache_stored", path=str(entry), size_bytes=entry.stat().st_size)
    except OSError as exc:
        log.warning("weight_cache_store_failed", path=str(entry), error=str(exc))
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


def reopen_mapped(entry: Path, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The entry just stored, as tensors backed by its file mapping, in place of `weights`.

    Right after a first start's conversion the weights sit in anonymous memory; served from the
    file instead, pages nobody reads (a packed layer's dense source, the embedding rows no prompt
    uses) can be released, as on a cache hit. `weights` is returned unchanged if the entry cannot be
    read back or differs from it in names, shapes or dtypes."""
    from safetensors import safe_open

    try:
        mapped = {}
        with safe_open(str(entry), framework="pt") as f:
            for name in f.keys():
                mapped[name] = f.get_tensor(name)
    except Exception as exc:  # noqa: BLE001 - the in-memory weights are as good, only larger
        log.warning("weight_cache_reopen_failed", path=str(entry), error=f"{type(exc).__name__}: {exc}")
        return weights
    same = mapped.keys() == weights.keys() and all(
        mapped[n].shape == t.shape and mapped[n].dtype == t.dtype for n, t in weights.items())
    return mapped if same else weights
