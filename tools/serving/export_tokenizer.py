"""Write a model's tokenizer as a Hugging Face tokenizer folder (tokenizer.json + tokenizer_config.json).

Outside tools that count tokens with `transformers.AutoTokenizer` (load generators such as aiperf)
need a folder; slipstream's default model ships as a GGUF. No hub access is involved.

    python tools/serving/export_tokenizer.py smollm2-135m /tmp/smollm2-tokenizer
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from slipstream.serve.tokenizer_load import load_tokenizer


def export(spec: str, out: Path) -> Path:
    tok, _ = load_tokenizer(spec)
    if not hasattr(tok, "backend"):
        raise SystemExit(f"{spec}: its tokenizer ({type(tok).__name__}) is not a tokenizers.Tokenizer")
    out.mkdir(parents=True, exist_ok=True)
    tok.backend.save(str(out / "tokenizer.json"))
    name = lambda i: None if i is None else tok.id_to_token(i)  # noqa: E731
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": name(tok.bos_token_id),
           "eos_token": name(tok.eos_token_ids[0]) if tok.eos_token_ids else None,
           "chat_template": tok.chat_template, "model_max_length": 8192}
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1))
    return out


if __name__ == "__main__":
    print(export(sys.argv[1], Path(sys.argv[2])))
