"""Reading the JSON files of a model folder (config, tokenizer and processor configs)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from slipstream.errors import CorruptModelError


def read_json_object(path: Path, strict: bool = False) -> dict[str, Any]:
    """The file's JSON object; {} if the file is absent. Invalid JSON is a CorruptModelError, and so
    is a value other than an object when `strict` (else it reads as {})."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CorruptModelError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        if strict:
            raise CorruptModelError(f"{path}: expected a JSON object")
        return {}
    return data
