"""The byte-stream detokenizer gives the window detokenizer's text, and is used only where it may be."""
import os
import random

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest

from slipstream.models.tokenizers.byte_stream import ByteStreamDetokenizer, byte_table, make_detokenizer
from slipstream.models.tokenizers.byte_tokenizer import ByteTokenizer
from slipstream.models.loading.gguf_loader import load_gguf_tokenizer
from slipstream.models.loading.loader import resolve_model_path
from slipstream.models.tokenizers.tokenizer import IncrementalDetokenizer, Tokenizer


@pytest.fixture(scope="module")
def smollm2():
    return load_gguf_tokenizer(resolve_model_path("smollm2-135m"))


def _texts(detok, ids, chunk):
    deltas = [detok.push(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    return deltas, detok.flush()


@pytest.mark.parametrize("which", ["byte", "smollm2"])
def test_random_ids_give_the_window_detokenizers_text(which, smollm2):
    tok = ByteTokenizer() if which == "byte" else smollm2
    rng = random.Random(7)
    text = tok.encode("Café 日本語 🤖🎉 👍🏽 ok")
    for trial in range(200):
        # random ids (specials, invalid and cut UTF-8 included), and real multi-byte text cut anywhere
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 30))]
        if trial % 2:
            ids = text[:rng.randrange(1, len(text) + 1)] + ids[:3]
        chunk = rng.choice([1, 2, 5])
        fast = make_detokenizer(tok, ids[:2])
        assert isinstance(fast, ByteStreamDetokenizer)
        deltas, tail = _texts(fast, ids, chunk)
        want, want_tail = _texts(IncrementalDetokenizer(tok), ids, chunk)
        assert "".join(deltas) + tail == "".join(want) + want_tail, ids


def test_a_character_cut_at_the_end_is_held_then_dropped(smollm2):
    ids = smollm2.encode("ok 🤖")
    detok = make_detokenizer(smollm2)
    deltas, tail = _texts(detok, ids[:-1], 1)  # the emoji's last byte never comes
    assert "".join(deltas) + tail == "ok "
    assert deltas[-1] == ""  # held back, not shown as U+FFFD


def test_sentencepiece_keeps_the_window_detokenizer():
    from model_families import spm_vocab

    v = spm_vocab()
    spm = Tokenizer.from_gguf_fields({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": v.tokens,
                                      "tokenizer.ggml.scores": v.scores, "tokenizer.ggml.token_type": v.types,
                                      "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2})
    assert byte_table(spm) is None  # its decoder drops/adds spaces by context
    assert isinstance(make_detokenizer(spm, [1]), IncrementalDetokenizer)


def test_an_added_token_off_the_byte_rule_disables_the_fast_path(smollm2):
    first_added = min(smollm2.backend.get_added_tokens_decoder())

    class Odd(Tokenizer):
        def decode(self, ids, skip_special_tokens=False):  # a backend spelling one added token its own way
            ids = list(ids)
            return "?" if ids == [first_added] else super().decode(ids, skip_special_tokens)

    odd = Odd(smollm2.backend, bos_token_id=1, eos_token_ids=[2], chat_template=None)
    assert byte_table(smollm2) is not None
    assert byte_table(odd) is None
    assert isinstance(make_detokenizer(odd), IncrementalDetokenizer)


def test_a_tokenizer_whose_table_cannot_be_built_keeps_the_window_detokenizer(smollm2):
    class Broken(Tokenizer):
        def decode(self, ids, skip_special_tokens=False):
            raise RuntimeError("decoder bug")

    broken = Broken(smollm2.backend, bos_token_id=1, eos_token_ids=[2], chat_template=None)
    assert byte_table(broken) is None  # logged, not raised: the engine still starts
