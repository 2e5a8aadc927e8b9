"""Tool calling without an engine: the grammar of each format and mode, the parser (streamed in any
pieces = parsed at once), the checks of every entry, format detection and the prompts it renders."""
import json
import random

import pytest
from grammar_helpers import smollm_tokenizer
from tool_schemas import NOT_OBJECTS, OBJECTS

from slipstream.errors import GrammarMatchError, InvalidRequestError
from slipstream.grammar.base import GrammarSpec
from slipstream.grammar.llguidance_backend import LLGuidanceGrammar
from slipstream.grammar.tool_calls import ToolGrammar, tool_grammar_value
from slipstream.models.tokenizers.byte_tokenizer import ByteTokenizer
from slipstream.models.tokenizers.tokenizer import Tokenizer
from slipstream.tool_calls.formats import FORMATS, HERMES, LLAMA3_JSON, SMOLLM2, format_of_template, render_prompt
from slipstream.tool_calls.parser import ToolCallParser
from slipstream.tool_calls.plan import ToolPlan
from slipstream.tool_calls.spec import MAX_TOOLS, tool_request

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 9}},
           "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"tz": {"enum": ["utc", "cet"]}}, "required": ["tz"],
        "additionalProperties": False}
TOOLS = [("get_weather", json.dumps(WEATHER)), ("get_time", json.dumps(TIME))]
W_ARGS, T_ARGS = '{"city": "Paris", "days": 3}', '{"tz": "utc"}'


@pytest.fixture(scope="module")
def smol():
    return smollm_tokenizer()  # shared with the grammar tests


def accepts(tok, syntax, mode, parallel, text, content=None) -> bool:
    """Whether the grammar takes every token of `text` (and the text may end there)."""
    spec = GrammarSpec("tool_calls", tool_grammar_value(ToolGrammar(syntax, TOOLS, mode, parallel, content)))
    m = LLGuidanceGrammar(spec, tok, tok.vocab_size).matcher()
    try:
        for t in tok.encode(text):
            m.accept(t)
        m.accept(tok.eos_token_ids[0])
    except GrammarMatchError:
        return False
    return True


def two_calls(syntax) -> str:
    return syntax.calls_text([("get_weather", W_ARGS), ("get_time", T_ARGS)])


@pytest.mark.parametrize("syntax", [HERMES, SMOLLM2, LLAMA3_JSON], ids=["hermes", "smollm2", "llama3"])
@pytest.mark.parametrize("tok_name", ["byte", "smollm2"])
def test_grammar_takes_valid_calls_and_nothing_else(syntax, tok_name, smol):
    tok = smol if tok_name == "smollm2" else ByteTokenizer(512)
    one = syntax.calls_text([("get_time", T_ARGS)])
    assert accepts(tok, syntax, "required", False, one)
    assert accepts(tok, syntax, "required", True, two_calls(syntax))
    assert not accepts(tok, syntax, "required", False, two_calls(syntax))  # parallel off: one call
    assert not accepts(tok, syntax, "required", True, "Sure. " + one)  # required: calls only
    assert not accepts(tok, syntax, "required", True, one.replace("get_time", "get_tine"))  # unknown function
    assert not accepts(tok, syntax, "required", True, one.replace('"utc"', '"gmt"'))  # not in the schema
    assert not accepts(tok, syntax, "required", True, one.replace('"tz"', '"zone"'))
    assert not accepts(tok, syntax, "required", True, syntax.calls_text([("get_weather", '{"city": "Paris"}')]))
    assert not accepts(tok, syntax, "required", True, one + " and more")
    assert accepts(tok, syntax, "auto", True, "No call is needed here.")
    assert accepts(tok, syntax, "auto", True, "")
    if syntax.at_start:  # Llama 3: calls open the answer, text may not look like one
        assert accepts(tok, syntax, "auto", False, one)
        assert not accepts(tok, syntax, "auto", False, '{"city": 1}')
    else:  # the lazy trigger: free text, then calls once the text reaches it
        assert accepts(tok, syntax, "auto", True, "Let me look that up. " + two_calls(syntax))
        assert accepts(tok, syntax, "auto", True, "a <tool or a tool_call> is text")
        assert not accepts(tok, syntax, "auto", True, "Let me look. <tool_call> oops")
        assert not accepts(tok, syntax, "auto", True, one + " then text")


def test_json_answer_or_calls(smol):
    schema = json.dumps({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})
    assert accepts(smol, HERMES, "auto", True, '{"n": 3}', content=schema)
    assert accepts(smol, HERMES, "auto", True, HERMES.calls_text([("get_time", T_ARGS)]), content=schema)
    assert not accepts(smol, HERMES, "auto", True, "free text", content=schema)
    assert not accepts(smol, HERMES, "auto", True, '{"m": 3}', content=schema)


def _pieces(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12)))) if len(text) > 1 else []
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


@pytest.mark.parametrize("syntax", [HERMES, SMOLLM2, LLAMA3_JSON], ids=["hermes", "smollm2", "llama3"])
def test_parser_streamed_in_any_pieces_equals_parsed_at_once(syntax):
    tricky = '{"city": "a}\\"]b{[<tool_call>", "days": 3}'  # brackets, quotes and the trigger inside a string
    answers = [(True, "", two_calls(syntax)), (True, "", syntax.calls_text([("get_weather", tricky)])),
               (False, "Plain text with <tool and {braces}", ""), (False, "x<", "")]
    if not syntax.at_start:
        answers.append((False, "Let me check.\n", two_calls(syntax)))
    rng = random.Random(0)
    for required, content, calls in answers:
        text = content + calls
        ids = iter(range(1000))
        whole = ToolCallParser(syntax, required, new_id=lambda: f"c{next(ids)}").parse(text)
        assert whole[0] == content
        if calls:
            assert [c.name for c in whole[1]] in (["get_weather", "get_time"], ["get_weather"])
            assert all(json.loads(c.arguments) for c in whole[1])
        for _ in range(20):
            ids = iter(range(1000))
            p = ToolCallParser(syntax, required, new_id=lambda: f"c{next(ids)}")
            got_content, got_calls = "", {}
            for piece in _pieces(text, rng):
                c, deltas = p.push(piece)
                got_content += c
                for d in deltas:
                    call = got_calls.setdefault(d.index, [d.id, d.name, ""])
                    assert d.id is None or call[0] == d.id
                    call[2] += d.arguments
            got_content += p.finish()[0]
            assert (got_content, [tuple(v) for v in got_calls.values()]) == (
                whole[0], [(c.id, c.name, c.arguments) for c in whole[1]])


SCALARS = ["1", "-2.5e3", '"hello"', '"a}]\\"</tool_call>"', "true", "null", "[1, {\"a\": [2]}]", "[]", '""']


@pytest.mark.parametrize("syntax", [HERMES, SMOLLM2, LLAMA3_JSON], ids=["hermes", "smollm2", "llama3"])
def test_arguments_that_are_not_an_object_end_at_their_call(syntax):
    """A value that is no object (a grammar that let the model write one) is the call's arguments up
    to the call's closing brace: the frame's text never leaks into them, the next call is found, and
    any pieces of the stream give the same answer."""
    rng = random.Random(1)
    for value in SCALARS:
        calls = [("get_weather", value), ("get_time", T_ARGS)] if syntax is not LLAMA3_JSON else [("get_weather", value)]
        text = syntax.calls_text(calls)
        whole = ToolCallParser(syntax, True, new_id=lambda: "c").parse(text)
        assert whole == ("", [_call(n, a) for n, a in calls]), (value, text)
        for _ in range(20):
            p = ToolCallParser(syntax, True, new_id=lambda: "c")
            got: dict[int, list[str]] = {}
            for piece in [*_pieces(text, rng), ""]:
                for d in p.push(piece)[1]:
                    got.setdefault(d.index, [d.name or "", ""])[1] += d.arguments
            p.finish()
            assert [tuple(v) for v in got.values()] == list(calls), (value, text)


def _call(name: str, arguments: str):
    from slipstream.outputs import ToolCall
    return ToolCall("c", name, arguments)


def test_parser_holds_back_a_possible_trigger_and_keeps_a_cut_call():
    p = ToolCallParser(HERMES, required=False)
    assert p.push("Hello <tool") == ("Hello ", [])
    assert p.push("box") == ("<toolbox", [])
    assert p.push(" <tool_c") == (" ", [])
    assert p.finish() == ("<tool_c", [])
    p = ToolCallParser(HERMES, required=True)
    p.push('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa')  # cut by max_tokens
    p.finish()
    assert [(c.name, c.arguments) for c in p.result()[1]] == [("get_weather", '{"city": "Pa')]


BAD = [
    ("tools", [{"type": "function", "function": {"name": "a b"}}], None, "tools[0].function.name"),
    ("tools", [{"type": "function", "name": "x" * 65}], None, "tools[0].name"),
    ("tools", [{"type": "retrieval"}], None, "tools[0].type"),
    ("tools", [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}], None,
     "tools[0].function.parameters"),
    ("tools", [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "wat"}}}}}], None, "tools[0].function.parameters"),
    ("tools", [{"type": "function", "name": "f"}, {"type": "function", "name": "f"}], None, "tools[1].name"),
    ("tools", [{"type": "function", "name": f"f{i}"} for i in range(MAX_TOOLS + 1)], None, "tools"),
    ("tools", [{"type": "function", "name": "f", "parameters": {"type": "object", "description": "x" * 300_000}}],
     None, "tools"),
    ("tool_choice", [{"type": "function", "name": "f"}], {"type": "function", "function": {"name": "g"}},
     "tool_choice"),
    ("tool_choice", [], "required", "tool_choice"),
    ("tool_choice", [{"type": "function", "name": "f"}], "sometimes", "tool_choice"),
]


@pytest.mark.parametrize("what,tools,choice,param", BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_bad_tools_name_their_field(what, tools, choice, param):
    with pytest.raises(InvalidRequestError) as e:
        tool_request(tools, choice)
    assert e.value.param == param, str(e.value)


@pytest.mark.parametrize("schema", NOT_OBJECTS, ids=[json.dumps(s)[:40] for s in NOT_OBJECTS])
@pytest.mark.parametrize("flat", [False, True], ids=["chat", "flat"])
def test_parameters_that_are_not_an_object_are_refused(schema, flat):
    tool = {"type": "function", "name": "f", "parameters": schema}
    field = "tools[0].parameters" if flat else "tools[0].function.parameters"
    with pytest.raises(InvalidRequestError) as e:
        tool_request([tool if flat else {"type": "function", "function": {k: v for k, v in tool.items()
                                                                            if k != "type"}}])
    assert e.value.param == field, str(e.value)


@pytest.mark.parametrize("schema", OBJECTS, ids=[json.dumps(s)[:40] for s in OBJECTS])
def test_parameters_that_describe_objects_are_taken(schema):
    (tool,) = tool_request([{"type": "function", "name": "f", "parameters": schema}]).tools
    assert tool.parameters == schema


def test_empty_parameters_mean_no_arguments():
    """`{}` (like no parameters): an empty arguments object, not any JSON value."""
    (empty,) = tool_request([{"type": "function", "name": "f", "parameters": {}}]).tools
    (none,) = tool_request([{"type": "function", "name": "f"}]).tools
    assert empty == none and json.loads(empty.schema_text())["type"] == "object"


CALL = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": W_ARGS}}
BAD_HISTORY = [  # (messages, the field named): what every entry refuses before the template runs
    ([{"role": "user", "content": "hi"}, {"role": "tool", "content": "18 C"}], "messages[1].tool_call_id"),
    ([{"role": "tool", "content": "18 C", "name": "get_weather"}], "messages[0].tool_call_id"),
    ([{"role": "assistant", "content": None, "tool_calls": [CALL]}, {"role": "tool", "tool_call_id": "c1",
                                                                      "content": "1"},
      {"role": "tool", "tool_call_id": None, "content": "2"}], "messages[2].tool_call_id"),
]


@pytest.mark.parametrize("messages,param", BAD_HISTORY, ids=[p for _, p in BAD_HISTORY])
def test_bad_history_names_its_field(messages, param):
    from slipstream import validate

    with pytest.raises(InvalidRequestError) as e:
        validate.messages(messages)
    assert e.value.param == param, str(e.value)


def _history(name: str) -> list[dict]:
    return [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Let me see.", "tool_calls": [
        CALL, {**CALL, "id": "c2", "function": {**CALL["function"], "name": name}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "1"}]


@pytest.mark.parametrize("name,with_tools", [("get_wether", True), ("a b", True), ("a b", False), ("", False),
                                             ("x" * 65, False)])
def test_history_calls_name_a_tool(name, with_tools):
    """A history call's name follows OpenAI's rule and, when the request has tools, is one of them."""
    from slipstream import validate
    from slipstream.tool_calls.plan import make_plan, tool_prompt

    tok = ByteTokenizer()
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
             {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
    plan = make_plan(tok, tools) if with_tools else None
    assert '"name": "get_time"' in tool_prompt(tok, validate.messages(_history("get_time")), plan)  # one of them
    with pytest.raises(InvalidRequestError) as e:
        tool_prompt(tok, validate.messages(_history(name)), plan)
    assert e.value.param == "messages[1].tool_calls[1].function.name", str(e.value)


def test_tool_request_modes():
    t = [{"type": "function", "function": {"name": "f"}}, {"type": "function", "name": "g"}]
    assert tool_request(None) is None
    assert tool_request(t).choice == "auto" and tool_request(t).parallel
    named = tool_request(t, {"type": "function", "function": {"name": "g"}})
    assert (named.choice, [x.name for x in named.callable], named.parallel) == ("required", ["g"], False)
    assert tool_request(t, "none", False).choice == "none"
    assert tool_request([], "auto").choice == "none"


QWEN_LIKE = ("{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>"
             "<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
             "{% for c in m.tool_calls or [] %}<tool_call>\n{{ {'name': c.function.name, 'arguments': "
             "c.function.arguments} | tojson }}\n</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
             "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LLAMA_LIKE = ("{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content }}"
              "{% if m.tool_calls %}{% if m.tool_calls | length > 1 %}{{ raise_exception('one call') }}{% endif %}"
              "{{ m.tool_calls[0].function.arguments | tojson }}{% endif %}<|eot_id|>{% endfor %}"
              "{% if tools %}[{{ tools | length }} tools]{% endif %}")


def test_formats_are_read_from_the_template(smol):
    assert format_of_template(QWEN_LIKE) is FORMATS["hermes"]
    assert format_of_template(LLAMA_LIKE + "tools") is FORMATS["llama3_json"]
    assert format_of_template(smol.chat_template) is FORMATS["smollm2"]
    assert format_of_template(None) is FORMATS["generic"]


HISTORY = [{"role": "user", "content": "Weather in Paris and Rome?"},
           {"role": "assistant", "content": "", "tool_calls": [
               {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": W_ARGS}},
               {"id": "c2", "type": "function", "function": {"name": "get_weather",
                                                             "arguments": W_ARGS.replace("Paris", "Rome")}}]},
           {"role": "tool", "tool_call_id": "c1", "content": "18 C"}, {"role": "tool", "tool_call_id": "c2",
                                                                       "content": "25 C"}]


def test_native_templates_get_the_tools_and_argument_objects(smol):
    request = tool_request([{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}])
    qwen = Tokenizer(smol.backend, bos_token_id=None, eos_token_ids=[2], chat_template=QWEN_LIKE)
    text = ToolPlan(request, format_of_template(QWEN_LIKE)).prompt(qwen, HISTORY)
    assert text.count('"name": "get_weather"') == 3  # the listed tool and both calls
    assert '{"name": "get_weather", "arguments": {"city": "Rome", "days": 3}}' in text  # an object, not a string
    llama = Tokenizer(smol.backend, bos_token_id=None, eos_token_ids=[2], chat_template=LLAMA_LIKE + "{# tools #}")
    text = ToolPlan(request, format_of_template(llama.chat_template)).prompt(llama, HISTORY)
    assert text.count("<|start_header_id|>assistant") == 2 and "[1 tools]" in text  # one call per message


def test_injected_prompt_shows_tools_calls_and_results(smol):
    request = tool_request([{"type": "function", "name": "get_weather", "parameters": WEATHER}])
    text = ToolPlan(request, FORMATS["smollm2"]).prompt(smol, HISTORY)
    assert text.startswith("<|im_start|>system\nYou can call these functions")
    assert ('<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, {"name": "get_weather", '
            '"arguments": {"city": "Rome", "days": 3}}]</tool_call><|im_end|>') in text
    assert "<|im_start|>user\n<tool_response>\n18 C\n</tool_response>\n<tool_response>\n25 C\n</tool_response>" in text
    plain = render_prompt(FORMATS["generic"], ByteTokenizer(), [{"role": "system", "content": "Be brief."}],
                          request.tools)
    assert plain.startswith("system: Be brief.\n\nYou can call these functions") and "<tool_call>\n{" in plain
