"""A moondream2 folder served by the Engine (the real pipeline, CPU device): the reference's query
prompt, the image through the encoder cache, and the bidirectional BOS + image prefix computed in
one chunk. Greedy tokens at depth 1 and 2 equal a full-sequence float64 forward of the oracle in
tests/test_moondream_model.py (dense, no paging, explicit prefix mask), on the tiny random layout
saved as a folder with the public names and a character-level tokenizer built here."""
import asyncio
import json
from types import SimpleNamespace

import numpy as np
import pytest
from image_util import picture
import torch

from slipstream import Engine, EngineConfig, InvalidRequestError, SamplingParams
from slipstream.errors import CorruptModelError
from slipstream.models.loading.build import build_model
from slipstream.models.moondream.image import preprocess
from slipstream.scheduler.chunking import prompt_shares
from test_moondream_model import CFG, D, r_hidden, r_image, r_logits, random_weights, save_folder, tiny_sections

PIL = pytest.importorskip("PIL.Image")
pytest.importorskip("tokenizers")

N = 8
# logprobs too: on random tiny weights the prefix's attention moves the logits by ~1e-2, too little
# to change a greedy token, but far above float32's error
GREEDY = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True, logprobs=True)
QUESTIONS = ["What is in the picture?", "Where?"]


def char_tokenizer():
    """Every printable character is one token; id 0 is <|endoftext|> (the tiny BOS and EOS)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models

    vocab = {t: i for i, t in enumerate(["<|endoftext|>"] + [chr(c) for c in range(32, 127)] + ["\n"])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<|endoftext|>"))
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken("<|endoftext|>", special=True, normalized=False)])
    return tok


@pytest.fixture(scope="module")
def md(tmp_path_factory):
    """(folder, float64 weights, tokenizer): templates written as ids, as the reference's config has them."""
    weights = random_weights(CFG, seed=0)
    tok = char_tokenizer()
    sections = tiny_sections(CFG)
    sections["tokenizer"]["templates"] = {"query": {"prefix": tok.encode("\n\nQuestion:").ids,
                                                    "suffix": tok.encode("\n\nAnswer:").ids}}
    folder = save_folder(tmp_path_factory.mktemp("mdserve") / "moondream-tiny",
                         {k: v.float() for k, v in weights.items()}, "current", sections)
    tok.save(str(folder / "tokenizer.json"))
    return folder, weights, tok



IMAGE = picture(60, 40, 0)
OTHER = picture(30, 30, 1)


def query_ids(tok, question):
    """The reference's query prompt, written out here: BOS, one placeholder per image token, the
    template's prefix ids, " " + question, the suffix ids."""
    t = CFG.text
    return ([t.bos_token_id] + [t.image_token_id] * CFG.vision.tokens_per_image + tok.encode("\n\nQuestion:").ids
            + tok.encode(" " + question).ids + tok.encode("\n\nAnswer:").ids)


def oracle_greedy(weights, tok, image, question, n=N):
    """Greedy tokens of a full-sequence float64 forward (the whole sequence again at every token)."""
    w = {k: v.float().to(D) for k, v in weights.items()}  # the folder holds float32 values
    processed = preprocess(image, CFG.vision)
    feats = r_image(processed.pixel_values.to(D), processed.tiling, w, CFG)
    ids, out, logprobs = query_ids(tok, question), [], []
    for _ in range(n):
        emb = w["text.wte"][torch.tensor(ids)].clone()
        emb[1:1 + feats.shape[0]] = feats
        logits = r_logits(r_hidden(emb, w, CFG, CFG.prefix_len)[-1:], w)[0]
        out.append(int(logits.argmax()))
        logprobs.append(float(torch.log_softmax(logits, -1)[out[-1]]))
        ids.append(out[-1])
    return out, logprobs


def config(folder, depth, **kw):
    base = dict(model=str(folder), pipeline_depth=depth, max_batch_size=4, max_num_batched_tokens=64,
                kv_cache_tokens=1024, page_size=8, seed=0)
    base.update(kw)
    return EngineConfig(**base)


@pytest.fixture(scope="module")
def want(md):
    _, weights, tok = md
    return {(q, i): oracle_greedy(weights, tok, im, q) for q in QUESTIONS for i, im in (("image", IMAGE), ("other", OTHER))}


def check(result, expected):
    tokens, logprobs = expected
    assert result.token_ids == tokens
    np.testing.assert_allclose(result.logprobs, logprobs, rtol=0, atol=1e-4)


def run_engine(cfg, jobs):
    """Each job a list of (question, image) run concurrently; the jobs one after another."""
    async def run():
        async with Engine(cfg) as engine:
            results = []
            for job in jobs:
                results.append(await asyncio.gather(*(engine.complete(q, GREEDY, images=[im]) for q, im in job)))
            return results, await engine.stats()
    return asyncio.run(run())


@pytest.mark.parametrize("depth", [1, 2])
def test_query_tokens_equal_the_oracle_and_the_encoder_cache_hits(md, want, depth):
    folder = md[0]
    # (no prefix caching: the repeat's cached pages would hold the whole image, which is then no hit)
    (first, pair), stats = run_engine(config(folder, depth, prefix_caching=False), [
        [(QUESTIONS[0], IMAGE)],
        [(QUESTIONS[1], IMAGE), ("<image>" + QUESTIONS[0], OTHER)]])  # a marker at the start is allowed
    check(first[0], want[(QUESTIONS[0], "image")])
    check(pair[0], want[(QUESTIONS[1], "image")])
    check(pair[1], want[(QUESTIONS[0], "other")])
    assert stats["encoder_cache_misses"] == 2 and stats["encoder_cache_hits"] == 1


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("caching", [False, True])
def test_a_small_step_budget_keeps_the_prefix_in_one_chunk(md, want, depth, caching):
    """20 tokens a step for prompts of 17 (prefix) + 27: water-filling two prompts would give each 10
    and split both prefixes; the prefix goes first (one request per step), the rest is chunked after
    it. With prefix caching the repeat maps the image's pages and its chunk starts inside the prefix."""
    folder = md[0]
    (pair, again), _ = run_engine(config(folder, depth, max_num_batched_tokens=20, prefix_caching=caching), [
        [(QUESTIONS[0], IMAGE), (QUESTIONS[1], OTHER)], [(QUESTIONS[1], IMAGE)]])
    check(pair[0], want[(QUESTIONS[0], "image")])
    check(pair[1], want[(QUESTIONS[1], "other")])
    check(again[0], want[(QUESTIONS[1], "image")])
    if caching:
        assert again[0].usage.cached_tokens > 0  # (pages of 8: the hit ends inside the 17-token prefix)


@pytest.mark.parametrize("depth", [1, 2])
def test_an_encoder_budget_cut_waits_for_the_whole_prefix(md, want, depth):
    """Room for one image's encode per step (16 rows): the second request's chunk would end before
    its image, after BOS alone, splitting its prefix; it waits for the next step instead."""
    folder = md[0]
    (pair,), stats = run_engine(config(folder, depth, max_encoder_tokens_per_step=16), [
        [(QUESTIONS[0], IMAGE), (QUESTIONS[1], OTHER)]])
    check(pair[0], want[(QUESTIONS[0], "image")])
    check(pair[1], want[(QUESTIONS[1], "other")])
    assert stats["encoder_cache_misses"] == 2


def test_a_prefix_larger_than_a_step_is_refused_by_name(md):
    folder = md[0]

    async def run():
        async with Engine(config(folder, 1, max_num_batched_tokens=16)) as engine:
            with pytest.raises(InvalidRequestError, match="max_num_batched_tokens") as err:
                await engine.complete(QUESTIONS[0], GREEDY, images=[IMAGE])
            assert err.value.param == "images"
            with pytest.raises(InvalidRequestError, match="exactly one image") as err:
                await engine.complete(QUESTIONS[0], GREEDY, images=[IMAGE, OTHER])
    asyncio.run(run())


def test_prompt_shares_give_a_prefix_its_whole_length_or_nothing():
    seq = lambda unscheduled, min_chunk: SimpleNamespace(num_unscheduled=unscheduled, min_chunk=min_chunk)  # noqa: E731
    assert prompt_shares([seq(44, 17), seq(44, 17)], 20) == [20, 0]  # 17 + 3 of the rest; the second waits
    assert prompt_shares([seq(44, 17), seq(10, 0)], 20) == [19, 1]  # the other 3 water-filled over 27 and 10
    assert prompt_shares([seq(44, 0), seq(44, 0)], 20) == [10, 10]  # no prefix: fair_shares unchanged
    assert prompt_shares([seq(30, 5), seq(40, 0)], 25) == [15, 10]


def test_build_model_detects_the_folder_and_needs_its_tokenizer(md, tmp_path):
    folder, weights, _ = md
    model, tokenizer, mcfg = build_model(str(folder), "float32", torch.device("cpu"))
    assert type(model).__name__ == "MoondreamForCausalLM" and mcfg.image_token_id == CFG.text.vocab_size - 1
    assert tokenizer.eos_token_ids == (0,) and tokenizer.bos_token_id == 0
    bare = save_folder(tmp_path / "no-tokenizer", {k: v.float() for k, v in weights.items()}, "current",
                       tiny_sections(CFG))
    with pytest.raises(CorruptModelError, match="tokenizer.json"):
        build_model(str(bare), "float32", torch.device("cpu"))
    assert json.loads((folder / "config.json").read_text())["model_type"] == "moondream1"


def test_generate_command_answers_a_query(md, want, tmp_path, capsys):
    """`slipstream generate --model <folder> --image x.png "question"`: no chat template, so the
    prompt is the query template (the greedy text is the oracle's)."""
    from slipstream.cli import main

    folder, _, tok = md
    IMAGE.save(tmp_path / "x.png")
    rc = main(["generate", "--model", str(folder), "--image", str(tmp_path / "x.png"), "--max-tokens", str(N),
               "--temperature", "0", QUESTIONS[0]])
    assert rc == 0
    tokens = want[(QUESTIONS[0], "image")][0]
    eos = tokens.index(0) if 0 in tokens else len(tokens)  # the command stops at EOS (id 0)
    assert tok.decode(tokens[:eos]) in capsys.readouterr().out


@pytest.mark.filterwarnings(r"ignore:(overflow|invalid value) encountered:RuntimeWarning")
def test_the_triton_backend_through_the_engine(md, want, monkeypatch):
    """What CUDA runs (the engine sets the triton backend there), on the CPU through Triton's
    interpreter: the runner uploads the bidirectional prefixes with the device metadata, and the
    answers equal the oracle's."""
    pytest.importorskip("triton")
    from slipstream.api import assemble

    def triton_model(*args, **kwargs):
        model, tokenizer, mcfg = build_model(*args, **kwargs)
        model.set_kernel_backend("triton")
        return model, tokenizer, mcfg

    monkeypatch.setattr(assemble, "build_model", triton_model)
    (pair,), _ = run_engine(config(md[0], 2), [[(QUESTIONS[0], IMAGE), (QUESTIONS[1], OTHER)]])
    check(pair[0], want[(QUESTIONS[0], "image")])
    check(pair[1], want[(QUESTIONS[1], "other")])
