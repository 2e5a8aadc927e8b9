"""What a stream yields (slipstream/api/interface.py): text in every delta but possibly the last, and
never a trailing U+FFFD when the output stops inside a multi-byte character. Checked on tiny-random
(byte-level ids, so a grammar can force the bytes of one character) through Engine.stream,
Client.stream (a worker) and the HTTP SSE endpoint."""
import asyncio
import codecs

import pytest
from serve_util import ThreadServer
from worker_util import engine_config, worker  # noqa: F401 (fixture)

from slipstream import Client, Engine, SamplingParams
from slipstream.models.tokenizers.byte_tokenizer import ByteTokenizer
from slipstream.models.tokenizers.tokenizer import IncrementalDetokenizer
from slipstream.serve import EngineBackend
from slipstream.serve.sse import parse

httpx = pytest.importorskip("httpx")

ROBOT = "ab\U0001F916!"  # the emoji is 4 bytes: tokens 3..6
CASES = [  # (forced text, max_tokens, stop, want text, want finish)
    (ROBOT, 4, None, "ab", "length"),  # cut after 2 of the emoji's 4 bytes: dropped, not '\ufffd'
    (ROBOT, 5, None, "ab", "length"),
    (ROBOT, 8, None, ROBOT, "stop"),  # whole: the emoji's 4 ids come with its text, in one delta
    ("x\ufffd", 8, None, "x\ufffd", "stop"),  # a U+FFFD the model spells out (EF BF BD) is kept
    ("abcdefgh", 16, ["xyz"], "abcdefgh", "stop"),  # text held back for a possible stop string
]


def _check(deltas: list[tuple[str, list[int], str | None]], want_text: str, want_finish: str, n_tokens: int):
    texts = [t for t, _, _ in deltas]
    assert all(texts[:-1]), f"an empty text delta before the last: {deltas}"
    assert [f for _, _, f in deltas] == [None] * (len(deltas) - 1) + [want_finish]
    assert "".join(texts) == want_text
    if n_tokens is not None:
        assert sum(len(ids) for _, ids, _ in deltas) == n_tokens  # every token id, once


def _params(forced: str, max_tokens: int, stop) -> SamplingParams:
    return SamplingParams(choice=[forced], max_tokens=max_tokens, temperature=0.0, stop=stop)


def _tokens(forced: str, max_tokens: int) -> int:
    return min(len(forced.encode()), max_tokens)  # byte-level ids: one token per byte


async def test_engine_stream():
    async with Engine(engine_config()) as engine:
        for forced, max_tokens, stop, want, finish in CASES:
            sp = _params(forced, max_tokens, stop)
            deltas = [(d.text, d.token_ids, d.finish_reason) async for d in engine.stream("hi", sp)]
            _check(deltas, want, finish, _tokens(forced, max_tokens))
            out = await engine.complete("hi", sp)
            assert (out.text, out.finish_reason) == (want, finish)
            assert [t for _, ids, _ in deltas for t in ids] == out.token_ids


async def test_engine_stream_aborted_inside_a_character():
    """Aborted after a number of steps that lands inside an emoji's bytes: the text ends on a whole
    character (the cut emoji's first bytes are dropped), and no text delta is empty but the last."""
    robots = "\U0001F916" * 40
    cut_inside = 0
    async with Engine(engine_config()) as engine:
        for k, steps in enumerate((2, 3, 4, 6, 7, 8)):
            start = (await engine.stats())["steps"]
            stream = engine.stream("hi", _params(robots, 160, None), request_id=f"r{k}")
            first = asyncio.create_task(anext(stream))
            while (await engine.stats())["steps"] < start + steps:
                await asyncio.sleep(0)
            assert await engine.abort(f"r{k}")
            deltas = [await first] + [d async for d in stream]
            out_ids = [t for d in deltas for t in d.token_ids]
            cut_inside += len(out_ids) % 4 != 0
            text = "".join(d.text for d in deltas)
            assert deltas[-1].finish_reason == "abort" and all(d.text for d in deltas[:-1])
            assert text == robots[:len(out_ids) // 4]
    assert cut_inside  # the case this test is about did happen


async def test_client_stream(worker):
    async with Client(worker.address, timeout=10) as client:
        for forced, max_tokens, stop, want, finish in CASES:
            sp = _params(forced, max_tokens, stop)
            deltas = [(d.text, d.token_ids, d.finish_reason) async for d in client.stream("hi", sp)]
            _check(deltas, want, finish, _tokens(forced, max_tokens))
            assert (await client.complete("hi", sp)).text == want


async def test_http_sse_stream():
    with ThreadServer(EngineBackend(engine_config())) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
            for forced, max_tokens, stop, want, finish in CASES:
                body = {"prompt": "hi", "max_tokens": max_tokens, "temperature": 0, "stream": True,
                        "choice": [forced], "stop": stop}
                events = parse((await http.post("/v1/completions", json=body)).text)
                chunks = [e["choices"][0] for e in events[:-1] if e.get("choices")]
                _check([(c["text"], [], c["finish_reason"]) for c in chunks], want, finish, None)


@pytest.mark.parametrize("text", ["Café 日本語 🤖🎉 done", "\ufffd\U0001F916é\ufffd"])
def test_detokenizer_every_cut_drops_only_the_cut_character(text):
    """Byte tokens, cut after each byte: the text is the decodable prefix, never a trailing U+FFFD."""
    tok = ByteTokenizer()
    ids = tok.encode(text)
    for cut in range(len(ids) + 1):
        detok = IncrementalDetokenizer(tok, tok.encode("prompt"))
        pieces = [detok.push([i]) for i in ids[:cut]]
        got = "".join(pieces) + detok.flush()
        assert got == codecs.getincrementaldecoder("utf-8")().decode(bytes(text.encode()[:cut])), cut
