"""`slipstream generate --model <folder>` and `slipstream serve --model <folder>` prompt with each
family's chat template exactly as transformers does: the ids the engine's scheduler receives are
AutoTokenizer.apply_chat_template's (tokenize=True: the rendered text without the tokenizer's own
special tokens, so a template that writes its BOS gets one).

Tiny random folders (family_chat.write_chat_folder): each family's tokenizer layout (Gemma's and
Mistral's tokenizer.json prepend a BOS, as the real ones do; Qwen3's and Phi-3's none) and its chat
template (family_chat.CHAT_TEMPLATES), in tokenizer_config.json or chat_template.jinja.
"""
import json

import pytest
from family_chat import CHAT_TEMPLATES, write_chat_folder

from slipstream.models.loading.loader import load_model
from slipstream.scheduler.engine_loop import EngineLoop

SYSTEM = {"role": "system", "content": "Be brief."}
CHATS = [
    [{"role": "user", "content": " Hi there "}],
    [SYSTEM, {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": " 4"},
     {"role": "user", "content": "And 3+3?\n"}],
]
QWEN3_THINKING = [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "<think>\nr1\n</think>\n\na1"},
                  {"role": "user", "content": "q2"}, {"role": "assistant", "content": "<think>r2</think>a2"}]
GEMMA3_PARTS = [{"role": "system", "content": [{"type": "text", "text": "Sys"}]},
                {"role": "user", "content": [{"type": "text", "text": " t1 "}, {"type": "text", "text": "t2"}]}]
IN_CONFIG = {"qwen3": False, "mistral-sw": True, "phi3": False, "gemma3": True}  # else chat_template.jinja


@pytest.fixture(scope="module", params=list(CHAT_TEMPLATES))
def chat_folder(request, tmp_path_factory):
    from transformers import AutoTokenizer

    name = request.param
    folder = tmp_path_factory.mktemp(f"chat-{name}")
    write_chat_folder(folder, name, CHAT_TEMPLATES[name], IN_CONFIG[name])
    return {"name": name, "folder": folder, "theirs": AutoTokenizer.from_pretrained(str(folder))}


def _their_ids(chat_folder, messages) -> list[int]:
    out = chat_folder["theirs"].apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.fixture
def submitted(monkeypatch):
    """The prompt ids of every sequence the engine's scheduler takes in (the engine runs unchanged)."""
    seen: list[list[int]] = []
    submit = EngineLoop.submit

    def spy(self, seq):
        seen.append(list(seq.prompt_ids))
        return submit(self, seq)

    monkeypatch.setattr(EngineLoop, "submit", spy)
    return seen


def test_the_template_renders_as_transformers(chat_folder):
    """Text, with and without the generation prompt; the family's own cases (Qwen3's reasoning turns,
    Gemma's parts); a conversation the template refuses is refused (Mistral's, Gemma's alternation)."""
    ours, theirs = load_model(str(chat_folder["folder"])).tokenizer, chat_folder["theirs"]
    extra = {"qwen3": [QWEN3_THINKING], "gemma3": [GEMMA3_PARTS]}.get(chat_folder["name"], [])
    for msgs in CHATS + extra:
        for gen in (True, False):
            want = theirs.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
            assert ours.apply_chat_template(msgs, add_generation_prompt=gen) == want, (msgs, gen)
    if chat_folder["name"] in ("mistral-sw", "gemma3"):
        bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
        with pytest.raises(Exception, match="user, assistant"):
            theirs.apply_chat_template(bad, tokenize=False)
        with pytest.raises(Exception, match="user, assistant"):
            ours.apply_chat_template(bad)


def test_generate_prompts_as_transformers(chat_folder, submitted, capsys):
    """`slipstream generate PROMPT --model <folder>`: one user message through the template; it answers."""
    from slipstream import cli

    rc = cli.main(["generate", "Hi there", "--model", str(chat_folder["folder"]), "--device", "cpu",
                   "--max-tokens", "3", "-q"])
    assert rc == 0
    assert submitted == [_their_ids(chat_folder, [{"role": "user", "content": "Hi there"}])]
    ids = submitted[0]
    bos = chat_folder["theirs"].bos_token_id
    assert ids.count(bos) == (1 if chat_folder["name"] in ("mistral-sw", "gemma3") else 0)  # (one BOS, not two)
    assert capsys.readouterr().out.strip()  # (the answer: random tokens, some text)


def test_serve_chat_completions_prompts_as_transformers(chat_folder, submitted):
    """`slipstream serve --model <folder>` (its backend as the command builds it): /v1/chat/completions of
    a system prompt and three turns; usage counts the same prompt."""
    from serve_util import ThreadServer, httpx

    from slipstream import cli
    from slipstream.commands.serve import build_backend

    args = cli.build_parser().parse_args(["serve", "--model", str(chat_folder["folder"]), "--device", "cpu"])
    messages = CHATS[1]
    with ThreadServer(build_backend(args)) as server:
        r = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                       json={"model": "m", "messages": messages, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    want = _their_ids(chat_folder, messages)
    assert submitted == [want]
    assert json.loads(r.text)["usage"]["prompt_tokens"] == len(want)


@pytest.mark.parametrize("chat_folder", ["gemma3"], indirect=True)
def test_engine_chat_prompts_as_transformers(chat_folder, submitted):
    """Engine.chat and Engine.chat_stream (what a `slipstream worker` runs for its clients) alike."""
    import asyncio

    from slipstream import Engine, EngineConfig, SamplingParams

    params = SamplingParams(max_tokens=2, temperature=0.0)

    async def run():
        async with Engine(EngineConfig(model=str(chat_folder["folder"]), device="cpu")) as engine:
            await engine.chat(CHATS[1], params)
            async for _ in engine.chat_stream(CHATS[1], params):
                pass

    asyncio.run(run())
    assert submitted == [_their_ids(chat_folder, CHATS[1])] * 2
