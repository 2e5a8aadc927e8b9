"""The OpenAI/vLLM sampling fields of SamplingParams: types and ranges checked at construction,
and the knobs the runner does not apply yet refused by the engine rather than ignored."""
import msgspec
import pytest

from slipstream import InvalidRequestError, SamplingParams


@pytest.mark.parametrize("kwargs, field", [
    (dict(n=0), "n"), (dict(n=1.0), "n"), (dict(n=True), "n"), (dict(n=129), "n"),
    (dict(presence_penalty=2.5), "presence_penalty"), (dict(presence_penalty="1"), "presence_penalty"),
    (dict(frequency_penalty=-2.01), "frequency_penalty"), (dict(frequency_penalty=float("nan")), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"), (dict(repetition_penalty=-1), "repetition_penalty"),
    (dict(repetition_penalty=None), "repetition_penalty"),
    (dict(min_p=-0.1), "min_p"), (dict(min_p=1.5), "min_p"), (dict(min_p=True), "min_p"),
    (dict(min_tokens=-1), "min_tokens"), (dict(min_tokens=2.0), "min_tokens"),
    (dict(max_tokens=4, min_tokens=5), "min_tokens"),
    (dict(top_logprobs=21), "top_logprobs"), (dict(top_logprobs=-1), "top_logprobs"),
    (dict(top_logprobs=1.0), "top_logprobs"),
])
def test_bad_values_raise_naming_the_field(kwargs, field):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kwargs)
    assert e.value.param == field


def test_edges_of_the_ranges_are_accepted():
    p = SamplingParams(n=128, presence_penalty=-2, frequency_penalty=2.0, repetition_penalty=0.01, min_p=1,
                       max_tokens=3, min_tokens=3, top_logprobs=20)
    assert p.n == 128 and p.min_tokens == 3
    assert SamplingParams(min_p=0.0, top_logprobs=0).logprobs is False


def test_top_logprobs_implies_logprobs():
    assert SamplingParams(top_logprobs=3).logprobs is True
    assert SamplingParams(top_logprobs=3, logprobs=False).logprobs is True


def test_the_new_fields_travel_through_msgpack_like_the_worker_decodes_them():
    p = SamplingParams(n=2, presence_penalty=0.5, min_p=0.1, min_tokens=2, top_logprobs=2)
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(p), type=SamplingParams)
    assert back == p
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(msgspec.msgpack.encode({"n": "2"}), type=SamplingParams)


def test_defaults_are_neutral():
    p = SamplingParams()
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.min_p, p.min_tokens,
            p.top_logprobs, p.n) == (0.0, 0.0, 1.0, 0.0, 0, 0, 1)


@pytest.mark.parametrize("regex", ["a{1000000}", "(a{100}){1000}", "x(ab){20000}"])
def test_a_regex_that_expands_past_the_matchers_reach_is_refused_at_the_call(regex):
    """issue 37, item 12: regex="a{1000000}" was accepted, then failed mid-generation with
    GrammarMatchError ("too many expressions constructed") after a 1.3 s first mask."""
    with pytest.raises(InvalidRequestError, match="repetition") as info:
        SamplingParams(regex=regex)
    assert info.value.param == "regex"


@pytest.mark.parametrize("regex", ["[a-z]{1,6}( [a-z]{1,6})?", "a{10000}", "(ab)*c+", r"\p{L}{3}", "[0-9]{1,20000}"])
def test_ordinary_regexes_pass(regex):
    assert SamplingParams(regex=regex).regex == regex
