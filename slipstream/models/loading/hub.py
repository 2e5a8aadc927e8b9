"""Hugging Face model ids (`org/name`, optionally `org/name@revision`) resolved to a local folder.

The local Hugging Face cache is read directly (its layout is stable and documented:
`<cache>/models--org--name/refs/<revision>` holds a commit hash, `snapshots/<commit>/` the files),
so an id that was downloaded once loads with no network and without `huggingface_hub` installed.
Only when the id is not cached, a hub is allowed (HF_HUB_OFFLINE unset) and `huggingface_hub` is
importable do we download, and then only the files slipstream reads.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from slipstream.errors import ModelNotFoundError

# org/name[@revision]; names of the hub's own rules (letters, digits, '-', '_', '.').
_HF_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<rev>[\w./-]+))?$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
# What a slipstream load reads from a repo: config, weights (safetensors or GGUF), tokenizer files.
DOWNLOAD_PATTERNS = ["*.json", "*.safetensors", "*.gguf", "*.jinja", "tokenizer*"]
_TRUE = {"1", "true", "yes", "on"}


def parse_hf_id(spec: str) -> tuple[str, str] | None:
    """(repo_id, revision) when `spec` is shaped like a hub id, else None."""
    m = _HF_ID.match(spec)
    if m is None or spec.endswith((".gguf", ".safetensors")):
        return None
    return m.group("repo"), m.group("rev") or "main"


def hf_cache_dir() -> Path:
    """The hub cache huggingface_hub itself would use, from the same environment variables."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.environ[var]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "huggingface" / "hub"


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


def cached_snapshot(repo_id: str, revision: str = "main", cache_dir: Path | None = None) -> Path | None:
    """The snapshot folder of `repo_id` at `revision` in the local cache, or None if it is not there."""
    repo_dir = (cache_dir or hf_cache_dir()) / ("models--" + repo_id.replace("/", "--"))
    snapshots = repo_dir / "snapshots"
    if _COMMIT.match(revision):
        commit = revision
    else:
        ref = repo_dir / "refs" / revision
        if not ref.is_file():
            return None
        commit = ref.read_text(encoding="utf-8").strip()
    folder = snapshots / commit
    return folder if folder.is_dir() else None


def model_in_snapshot(folder: Path, spec: str) -> Path:
    """The loadable thing in a snapshot: the folder itself (config.json + safetensors) or its one GGUF."""
    if (folder / "config.json").is_file() and any(folder.glob("*.safetensors")):
        return folder
    ggufs = sorted(folder.glob("*.gguf"))
    if len(ggufs) == 1:
        return ggufs[0]
    if ggufs:
        names = ", ".join(g.name for g in ggufs)
        raise ModelNotFoundError(f"{spec}: the cached repo {folder} holds several GGUF files ({names}); "
                                 f"pass the path of the one to load")
    raise ModelNotFoundError(f"{spec}: the cached snapshot {folder} has neither config.json + *.safetensors "
                             f"nor a .gguf file")


def _download(repo_id: str, revision: str, cache_dir: Path, spec: str) -> Path:
    try:
        from huggingface_hub import snapshot_download
    except ImportError as exc:
        raise ModelNotFoundError(f"{spec}: not in the Hugging Face cache {cache_dir}, and huggingface_hub is not "
                                 f"installed to download it (pip install huggingface_hub)") from exc
    try:
        path = snapshot_download(repo_id, revision=revision, cache_dir=str(cache_dir),
                                 allow_patterns=DOWNLOAD_PATTERNS)
    except Exception as exc:  # network, auth, unknown repo: all mean "cannot have it"
        raise ModelNotFoundError(f"{spec}: not in the Hugging Face cache {cache_dir}, and downloading it failed "
                                 f"({type(exc).__name__}: {exc})") from exc
    return Path(path)


def resolve_hf_id(spec: str) -> Path | None:
    """A local path for a hub id (downloading if allowed), None when `spec` is not shaped like an id.

    Raises ModelNotFoundError naming the id, the cache directory searched and why nothing was found.
    """
    parsed = parse_hf_id(spec)
    if parsed is None:
        return None
    repo_id, revision = parsed
    cache_dir = hf_cache_dir()
    folder = cached_snapshot(repo_id, revision, cache_dir)
    if folder is None:
        if hub_offline():
            raise ModelNotFoundError(
                f"{spec}: not in the Hugging Face cache {cache_dir} (looked for "
                f"models--{repo_id.replace('/', '--')} at revision {revision!r}) and HF_HUB_OFFLINE is set")
        folder = _download(repo_id, revision, cache_dir, spec)
    return model_in_snapshot(folder, spec)
