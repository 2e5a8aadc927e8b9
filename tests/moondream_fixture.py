"""A tiny random-weight Moondream folder with the point/detect templates, for tools and tests
(tools/soak/soak.py --skills-model moondream, tools/bench/bench_detect.py, tests/test_serve_skills.py).

The same folder tests/test_moondream_skills.py builds in its `md` fixture (MoondreamConfig.tiny(),
seed 0, the public "current" tensor names, the byte-level character tokenizer, the reference's
point/detect prompt templates as ids), made callable outside pytest.
"""
from __future__ import annotations

from pathlib import Path

import pytest

SEED = 0


def tiny_moondream_folder(path: str | Path, seed: int = SEED) -> Path:
    from test_moondream_model import CFG, random_weights, save_folder, tiny_sections
    from test_moondream_skills import byte_level_tokenizer

    weights = random_weights(CFG, seed=seed)
    tok = byte_level_tokenizer()
    ids = lambda s: tok.encode(s).ids  # noqa: E731
    sections = tiny_sections(CFG)
    sections["tokenizer"]["templates"] = {
        "query": {"prefix": ids("\n\nQuestion:"), "suffix": ids("\n\nAnswer:")},
        "point": {"prefix": ids("\n\nPoint:"), "suffix": ids("\n\n")},
        "detect": {"prefix": ids("\n\nDetect:"), "suffix": ids("\n\n")}}
    folder = save_folder(Path(path), {k: v.float() for k, v in weights.items()}, "current", sections)
    tok.save(str(folder / "tokenizer.json"))
    return folder


@pytest.fixture(scope="session")
def moondream_folder(tmp_path_factory) -> Path:
    pytest.importorskip("tokenizers")
    return tiny_moondream_folder(tmp_path_factory.mktemp("tiny-moondream") / "moondream-tiny")
