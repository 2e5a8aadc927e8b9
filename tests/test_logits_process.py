"""Batched logit processing (slipstream/runtime/sampling/logits_process.py) against independent references:
transformers' logits processors where one exists, a plain per-row loop otherwise. Every row of a
batch has its own parameters, and neutral rows must come out bit-identical."""
import math

import pytest
import torch

from slipstream.params import SamplingParams
from slipstream.runtime.sampling.logits_process import (ProcessFlags, apply_penalties, flat_rows, min_p_filter,
                                                        process_flags, process_logits, record_sampled, reset_rows,
                                                        suppress_stop_tokens, top_logprobs)
from slipstream.runtime.step.row_tables import HistoryTables
from slipstream.runtime.sampling.sampler import sample
from slipstream.runtime.sampling.sampling_args import SamplingArgs

pytest.importorskip("transformers")
from transformers import (MinNewTokensLengthLogitsProcessor, MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,  # noqa: E402
                          TemperatureLogitsWarper)

V = 97


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _histories(n, seed, prompt_len=12, out_len=9):
    g = _gen(seed)
    prompts = [torch.randint(0, V, (prompt_len,), generator=g).tolist() for _ in range(n)]
    outputs = [torch.randint(0, V // 3, (out_len - i % 4,), generator=g).tolist() for i in range(n)]  # repeats
    return prompts, outputs


def _tables(prompts, outputs, stops=None, vocab=V):
    n = len(prompts)
    tables = HistoryTables(n + 2, vocab, "cpu")  # more table rows than the batch uses
    rows = list(range(1, n + 1))
    tables.admit(rows, prompts, outputs, stops or [[] for _ in prompts])
    return tables.gather(torch.tensor(rows))


def test_repetition_penalty_matches_transformers_per_row():
    n = 6
    prompts, outputs = _histories(n, 1)
    logits = torch.randn(n, V, generator=_gen(2)) * 3
    repetition = torch.tensor([1.0, 1.3, 0.7, 2.0, 1.0, 1.1])
    zeros = torch.zeros(n)
    counts, prompt_mask, _ = _tables(prompts, outputs)
    got = apply_penalties(logits, counts, prompt_mask, zeros, zeros, repetition)
    for i in range(n):
        history = torch.tensor([prompts[i] + outputs[i]])
        want = RepetitionPenaltyLogitsProcessor(float(repetition[i]))(history, logits[i : i + 1].clone())[0]
        torch.testing.assert_close(got[i], want, rtol=0, atol=0)


def test_presence_and_frequency_penalties_count_the_output_only():
    n = 5
    prompts, outputs = _histories(n, 3)
    logits = torch.randn(n, V, generator=_gen(4))
    presence = torch.tensor([0.0, 0.5, -1.0, 2.0, 0.0])
    frequency = torch.tensor([0.0, 0.3, 0.0, -2.0, 1.5])
    counts, prompt_mask, _ = _tables(prompts, outputs)
    got = apply_penalties(logits, counts, prompt_mask, presence, frequency, torch.ones(n))
    for i in range(n):
        want = logits[i].clone()
        for token in set(outputs[i]):  # the plain definition, token by token
            c = outputs[i].count(token)
            want[token] -= float(presence[i]) + float(frequency[i]) * c
        torch.testing.assert_close(got[i], want, rtol=1e-6, atol=1e-6)
        untouched = [t for t in range(V) if t not in outputs[i]]
        assert torch.equal(got[i, untouched], logits[i, untouched])  # prompt tokens are not penalised


def test_penalties_combine_in_vllm_order():
    prompts, outputs = [[5, 6]], [[6, 6, 7]]
    logits = torch.zeros(1, V)
    logits[0, 5], logits[0, 6], logits[0, 7], logits[0, 8] = 2.0, -2.0, 4.0, 1.0
    counts, prompt_mask, _ = _tables(prompts, outputs)
    got = apply_penalties(logits, counts, prompt_mask, torch.tensor([0.5]), torch.tensor([0.25]), torch.tensor([2.0]))
    assert got[0, 5].item() == 1.0  # prompt only: repetition alone
    assert got[0, 6].item() == -2.0 * 2 - 0.25 * 2 - 0.5
    assert got[0, 7].item() == 4.0 / 2 - 0.25 - 0.5
    assert got[0, 8].item() == 1.0  # never seen


def test_neutral_rows_are_bit_identical_and_greedy_unchanged():
    n = 8
    prompts, outputs = _histories(n, 5)
    logits = torch.randn(n, V, generator=_gen(6)) * 10
    logits[0, 3] = float("-inf")  # a grammar-masked token stays masked
    logits[1, 4] = -0.0
    counts, prompt_mask, stop_mask = _tables(prompts, outputs, stops=[[1, 2]] * n)
    zeros = torch.zeros(n)
    x = apply_penalties(logits, counts, prompt_mask, zeros, zeros, torch.ones(n))
    x = suppress_stop_tokens(x, stop_mask, torch.arange(n), torch.zeros(n, dtype=torch.int64))
    x = min_p_filter(x, torch.ones(n), zeros)
    assert torch.equal(x, logits) and math.copysign(1.0, x[1, 4].item()) == -1.0
    assert torch.equal(x.argmax(-1), logits.argmax(-1))
    # greedy rows are left alone by min_p even when it is set
    assert torch.equal(min_p_filter(logits, torch.zeros(n), torch.full((n,), 0.9)), logits)


def test_mixed_batch_touches_only_the_rows_that_ask():
    n = 4
    prompts, outputs = _histories(n, 7)
    logits = torch.randn(n, V, generator=_gen(8))
    counts, prompt_mask, _ = _tables(prompts, outputs)
    got = apply_penalties(logits, counts, prompt_mask, torch.tensor([0.0, 1.0, 0.0, 0.0]),
                          torch.tensor([0.0, 0.0, 0.0, 0.7]), torch.tensor([1.0, 1.0, 1.5, 1.0]))
    assert torch.equal(got[0], logits[0])
    assert not torch.equal(got[1], logits[1]) and not torch.equal(got[2], logits[2])
    assert not torch.equal(got[3], logits[3])


@pytest.mark.parametrize("seed", [0, 1])
def test_min_p_matches_transformers_after_temperature(seed):
    n = 6
    logits = torch.randn(n, V, generator=_gen(10 + seed)) * 4
    temperature = torch.tensor([0.5, 1.0, 1.0, 2.0, 0.7, 1.3])
    min_p = torch.tensor([0.0, 0.05, 0.2, 0.5, 1.0, 0.1])
    got = min_p_filter(logits, temperature, min_p)
    for i in range(n):
        scaled = TemperatureLogitsWarper(float(temperature[i]))(None, logits[i : i + 1].clone())
        want = MinPLogitsWarper(float(min_p[i]))(None, scaled)[0] if min_p[i] > 0 else scaled[0]
        assert torch.equal(torch.isinf(got[i]), torch.isinf(want)), i
        kept = ~torch.isinf(got[i])
        assert torch.equal(got[i, kept], logits[i, kept])  # kept logits are unscaled (the sampler scales)
    assert torch.isinf(got[4]).sum() == V - 1  # min_p 1: only the top token (no ties in random logits)


def test_min_tokens_matches_transformers_per_row():
    n, prompt_len = 5, 7
    logits = torch.randn(n, V, generator=_gen(20))
    stops = [[0], [0, 9], [9, 10, 11], [], [0]]
    output_index = torch.tensor([0, 2, 3, 0, 5])
    min_tokens = torch.tensor([1, 3, 3, 4, 2])
    _, _, stop_mask = _tables([[1]] * n, [[]] * n, stops=stops)
    got = suppress_stop_tokens(logits, stop_mask, output_index, min_tokens)
    for i in range(n):
        if not stops[i]:
            assert torch.equal(got[i], logits[i])
            continue
        history = torch.zeros(1, prompt_len + int(output_index[i]), dtype=torch.int64)
        proc = MinNewTokensLengthLogitsProcessor(prompt_len, int(min_tokens[i]), stops[i])
        assert torch.equal(got[i], proc(history, logits[i : i + 1])[0]), i


def test_min_tokens_never_leaves_a_row_without_a_token():
    logits = torch.full((2, V), float("-inf"))
    logits[:, 0] = 1.0  # a grammar that can only end: EOS is the one allowed token
    logits[1, 5] = 0.5
    stop_mask = torch.zeros(2, V, dtype=torch.bool)
    stop_mask[:, 0] = True
    got = suppress_stop_tokens(logits, stop_mask, torch.zeros(2, dtype=torch.int64), torch.full((2,), 3))
    assert got[0, 0].item() == 1.0  # kept: nothing else is allowed
    assert got[1].argmax().item() == 5 and got[1, 0].item() == float("-inf")


def test_top_logprobs_are_the_models_own_top_k():
    n, k = 4, 5
    logits = torch.randn(n, V, generator=_gen(30)) * 2
    values, ids = top_logprobs(logits, k)
    assert values.shape == ids.shape == (n, k)
    for i in range(n):
        lp = [float(x) - math.log(sum(math.exp(float(y)) for y in logits[i])) for x in logits[i]]
        order = sorted(range(V), key=lambda t: -lp[t])[:k]
        assert ids[i].tolist() == order
        assert values[i].tolist() == pytest.approx([lp[t] for t in order], abs=1e-5)
    assert (values[:, :-1] >= values[:, 1:]).all()


def test_record_sampled_updates_the_chosen_rows_only():
    counts = torch.zeros(6, V, dtype=torch.int32)
    record_sampled(counts, torch.tensor([1, 4, 2]), torch.tensor([7, 7, 0]))
    record_sampled(counts, torch.tensor([1, 4]), torch.tensor([7, 3]))
    want = torch.zeros(6, V, dtype=torch.int32)
    want[1, 7], want[4, 7], want[2, 0], want[4, 3] = 2, 1, 1, 1
    assert torch.equal(counts, want)


def test_reset_rows_clears_what_the_previous_owner_left():
    counts = torch.ones(4, V, dtype=torch.int32)
    prompt_mask = torch.ones(4, V, dtype=torch.bool)
    stop_mask = torch.ones(4, V, dtype=torch.bool)
    p_ids, p_rows, o_ids, o_rows, s_ids, s_rows = (torch.from_numpy(a) for lists in ([[3, 3, 5]], [[8, 8, 8]], [[0]])
                                                   for a in flat_rows([2], lists))
    reset_rows(counts, prompt_mask, stop_mask, torch.tensor([2]), p_ids, p_rows, o_ids, o_rows, s_ids, s_rows)
    assert counts[2].sum().item() == 3 and counts[2, 8].item() == 3
    assert prompt_mask[2].nonzero().flatten().tolist() == [3, 5]
    assert stop_mask[2].nonzero().flatten().tolist() == [0]
    assert bool(counts[[0, 1, 3]].eq(1).all() and prompt_mask[[0, 1, 3]].all())  # other rows untouched


def test_flags_say_which_steps_a_group_needs():
    plain = SamplingParams()
    assert process_flags([plain, SamplingParams(temperature=0.0)], [0, 3]) == ProcessFlags(False, False, False, 0)
    assert process_flags([plain, SamplingParams(repetition_penalty=1.1)], [0, 0]).penalties
    assert process_flags([SamplingParams(presence_penalty=-0.5)], [0]).penalties
    assert process_flags([SamplingParams(frequency_penalty=0.1)], [0]).penalties
    assert process_flags([SamplingParams(min_tokens=3)], [2]).min_tokens
    assert not process_flags([SamplingParams(min_tokens=3)], [3]).min_tokens  # reached
    assert not process_flags([SamplingParams(min_p=0.2, temperature=0.0)], [0]).min_p  # greedy: no effect
    assert process_flags([SamplingParams(min_p=0.2)], [0]).min_p
    assert process_flags([SamplingParams(top_logprobs=3), SamplingParams(top_logprobs=5)], [0, 0]).top_logprobs == 5


def _logits_at(step, n):
    """A fixed 'model': logits that favour a few tokens, so penalties change the choices."""
    base = torch.randn(n, V, generator=_gen(100 + step))
    base[:, :4] += 6.0
    return base


def test_decode_steps_with_persistent_tables_match_a_per_row_history_loop():
    """Tables kept across steps (admit once, record after each sampling) give what recomputing the
    penalties from each row's full history gives: the wiring the runner uses, step by step."""
    n, steps = 4, 12
    prompts = [[1, 2], [0], [3, 3, 5], [9]]
    presence = torch.tensor([0.0, 1.0, 0.5, 0.0])
    frequency = torch.tensor([0.0, 0.5, 0.0, 2.0])
    repetition = torch.tensor([1.0, 1.0, 1.5, 1.2])
    params = [SamplingParams(temperature=0.0, presence_penalty=float(p), frequency_penalty=float(f),
                             repetition_penalty=float(r)) for p, f, r in zip(presence, frequency, repetition)]
    tables = HistoryTables(8, V, "cpu")
    rows = torch.tensor([5, 0, 7, 2])  # table rows are not batch positions
    tables.admit(rows.tolist(), prompts, [[] for _ in prompts], [[] for _ in prompts])
    outputs = [[] for _ in range(n)]
    zero = torch.zeros(n)
    for step in range(steps):
        logits = _logits_at(step, n)
        counts, prompt_mask, stop_mask = tables.gather(rows)
        flags = process_flags(params, [step] * n)
        x = process_logits(logits, flags, counts, prompt_mask, stop_mask, presence, frequency, repetition,
                           torch.full((n,), step), torch.zeros(n, dtype=torch.int64), zero, zero)
        ids = sample(x, SamplingArgs(torch.full((n,), step)))  # greedy: no draw
        tables.record(rows, ids)
        for i in range(n):  # the reference: from the row's whole history, token by token
            want = logits[i].clone()
            for t in range(V):
                c = outputs[i].count(t)
                if c or t in prompts[i]:
                    r = float(repetition[i])
                    want[t] = want[t] / r if want[t] > 0 else want[t] * r
                want[t] -= float(frequency[i]) * c + (float(presence[i]) if c else 0.0)
            assert int(ids[i]) == int(want.argmax()), (step, i)
            outputs[i].append(int(ids[i]))
    assert outputs[0] == [int(_logits_at(s, n)[0].argmax()) for s in range(steps)]  # neutral row: plain greedy
    assert len(set(outputs[3])) > 1  # the frequency penalty moved row 3 off its favourite


@pytest.mark.cuda
def test_the_same_results_on_cuda():
    n = 6
    prompts, outputs = _histories(n, 40)
    logits = torch.randn(n, V, generator=_gen(41)) * 3
    args = dict(presence=torch.tensor([0.0, 0.5, 0, 1, 0, -1]), frequency=torch.tensor([0.0, 0, 0.3, 1, 0, 0]),
                repetition=torch.tensor([1.0, 1, 1, 1.3, 0.8, 1]))
    counts, prompt_mask, stop_mask = _tables(prompts, outputs, stops=[[0, 1]] * n)
    cpu = apply_penalties(logits, counts, prompt_mask, **args)
    cuda = apply_penalties(logits.cuda(), counts.cuda(), prompt_mask.cuda(), **{k: v.cuda() for k, v in args.items()})
    torch.testing.assert_close(cuda.cpu(), cpu)
    t, mp = torch.tensor([1.0, 0.5, 0, 2, 1, 1]), torch.tensor([0.1, 0.2, 0.5, 0, 1, 0.05])
    assert torch.equal(torch.isinf(min_p_filter(logits.cuda(), t.cuda(), mp.cuda()).cpu()),
                       torch.isinf(min_p_filter(logits, t, mp)))
    idx, mt = torch.arange(n), torch.full((n,), 3)
    assert torch.equal(suppress_stop_tokens(logits.cuda(), stop_mask.cuda(), idx.cuda(), mt.cuda()).cpu(),
                       suppress_stop_tokens(logits, stop_mask, idx, mt))
    tables = HistoryTables(8, V, "cuda")
    tables.admit([3], [[1, 1, 2]], [[4]], [[0]])
    tables.record(torch.tensor([3], device="cuda"), torch.tensor([4], device="cuda"))
    assert tables.output_counts[3, 4].item() == 2 and tables.prompt_mask[3].sum().item() == 2
    values, ids = top_logprobs(logits.cuda(), 4)
    ref_values, ref_ids = top_logprobs(logits, 4)
    assert torch.equal(ids.cpu(), ref_ids)
    torch.testing.assert_close(values.cpu(), ref_values)
