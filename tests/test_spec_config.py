"""SpeculativeConfig's numeric options: each has a documented range (params.MAX_*), refused outside it
at construction, naming the field, whichever way the config is built (docs/speculative.md)."""
import msgspec
import pytest

from slipstream import params
from slipstream.cli import main
from slipstream.errors import InvalidRequestError
from slipstream.params import EngineConfig, SpeculativeConfig

# every integer option and its upper bound; a new one must be added here (test below)
MAXIMA = {"num_drafts": params.MAX_NUM_DRAFTS, "min_n": params.MAX_NGRAM, "max_n": params.MAX_NGRAM,
          "window": params.MAX_WINDOW, "draft_context": params.MAX_DRAFT_CONTEXT}


def test_every_integer_option_has_a_bound_here():
    ints = {f.name for f in msgspec.structs.fields(SpeculativeConfig) if f.type is int}
    assert ints == set(MAXIMA)


def _out_of_range(field):
    top = MAXIMA[field]
    return [0, -1, -(10 ** 9), top + 1, 20_000_000, 10 ** 9, 2 ** 63, 4.0, float("nan"), "4", True, None, [4]]


@pytest.mark.parametrize("field,value", [(f, v) for f in MAXIMA for v in _out_of_range(f)])
def test_out_of_range_or_wrong_type_is_refused_naming_the_field(field, value):
    """issue 48, item 5: window=20_000_000 was accepted (32 tokens: 0.06 s became 10 s and 1.16 GB)."""
    for build in (lambda: SpeculativeConfig(**{field: value}),
                  lambda: EngineConfig(speculative={field: value})):  # (a dict: HTTP, Ray)
        with pytest.raises(InvalidRequestError) as e:
            build()
        assert e.value.param == f"speculative.{field}", (field, value, e.value)


def test_each_maximum_itself_is_accepted():
    SpeculativeConfig(num_drafts=MAXIMA["num_drafts"], min_n=MAXIMA["min_n"], max_n=MAXIMA["max_n"],
                      window=MAXIMA["window"], draft_context=MAXIMA["draft_context"])


def test_the_cli_refuses_an_out_of_range_num_drafts_in_one_line(capsys):
    argv = ["generate", "hi", "--model", "tiny-random", "--speculative", "ngram",
            "--num-drafts", str(params.MAX_NUM_DRAFTS + 1)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("slipstream: error: ") and err.count("\n") == 1 and "num_drafts" in err, err


def test_draft_model_and_method_disagreeing_say_which_is_missing():
    with pytest.raises(InvalidRequestError, match="method 'draft' needs speculative.draft_model") as e:
        SpeculativeConfig(method="draft")
    assert e.value.param == "speculative.draft_model"
    with pytest.raises(InvalidRequestError, match="read only with method 'draft', not 'ngram'") as e:
        SpeculativeConfig(method="ngram", draft_model="tiny-random")
    assert e.value.param == "speculative.draft_model"
