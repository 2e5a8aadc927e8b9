"""Verifying drafts on the device: which drafted tokens a speculating row accepts, and what it emits.

A speculating row feeds k + 1 positions to one forward: its last token x0, then drafts d1..dk (k may
differ per row, 0 included). The logits at position j predict the token after d_j (after x0 for
j = 0). A group's positions are flat, row after row (`SpecLayout`): logits [P, V], P = sum(k_i + 1);
drafts are padded [n, K]. Nothing here reads the host: the accepted counts, the emitted tokens and
each row's next input stay on the device (docs/speculative.md).

Three acceptance rules; each keeps the output distribution exactly the target model's (which rows use
which: docs/speculative.md, "Acceptance"):

replay (`replay_accept`): every position is sampled as non-speculative decoding samples that output
    index (sampler.sample_group on `expand_args`: penalties counting the drafts before it, the
    position's grammar mask, min_tokens at its own index, Gumbel-max noise keyed on (seed, output
    index)); a row accepts the longest prefix of drafts equal to those samples and emits the sample
    after it. By induction on j the emitted tokens are the tokens non-speculative decoding emits from
    the same logits, token for token, seeded rows included, whatever k and the drafts were. For a
    drafter that proposes one token per position (n-gram, a greedy draft model) d is accepted with
    probability p(d): the most any rule can accept.

rejection (`rejection_accept`; Leviathan et al. 2023, Chen et al. 2023): for drafts drawn from a draft
    distribution q: accept d_j with probability min(1, p(d_j) / q(d_j)); at the first rejection draw
    from norm(max(p - q, 0)); after k acceptances draw the bonus token from p. It accepts with
    probability 1 - TV(p, q), more than replay of drafts drawn with the target's noise, but a seeded
    row's tokens then depend on its drafts (and so on k), not on the seed alone.

point drafts (`rejection_accept` without draft_probs): rejection with q a point mass at the draft:
    replay's acceptance, p(d), from one row of noise per row instead of one per position.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from slipstream.runtime.devices.host_copy import upload_array
from slipstream.runtime.sampling.sampler import draw_logits, hash32, process_group, row_keys, sample_group, uniforms
from slipstream.runtime.sampling.sampling_args import Draw, Penalties, SamplingArgs, TopKTopP

# sub-streams of a position's key, so acceptance and residual noise are not the draw's noise
_ACCEPT_SALT, _RESIDUAL_SALT = 0x3C6EF372, 0x5851F42D
NO_TOKEN = -1  # padding of drafts and emitted tokens: equal to no token id


class SpecLayout(NamedTuple):
    """Where a group's speculating rows sit in the flat positions of its logits."""

    num_drafts: torch.Tensor  # [n] k_i
    owner: torch.Tensor  # [P] the group row of each position
    offset: torch.Tensor  # [P] j: 0 for x0's position, i for d_i's
    start: torch.Tensor  # [n] each row's first position
    max_drafts: int  # K, the width of the drafts tensors


def layout_arrays(num_drafts, max_drafts: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray,
                                                                      np.ndarray, int]:
    """(k, owner, offset, start) of `SpecLayout` as host arrays, and the width K: built on the host
    from the per-row draft counts the host chose (no device read)."""
    k = np.asarray(num_drafts, np.int64)
    counts = k + 1
    start = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    owner = np.repeat(np.arange(len(k), dtype=np.int64), counts)
    offset = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(start, counts)
    width = int(k.max(initial=0)) if max_drafts is None else max_drafts
    if len(k) and int(k.max()) > width:
        raise ValueError(f"a row has {int(k.max())} drafts, more than max_drafts={width}")
    return k, owner, offset, start, width


def spec_layout(num_drafts, device: torch.device | str = "cpu", max_drafts: int | None = None) -> SpecLayout:
    """The layout for per-row draft counts the host chose. Off the CPU each array goes up through
    pinned memory without blocking the host (host_copy.upload_array); the runner's steps stage theirs
    in the slot's buffers instead (speculation/staging.py, `SpecStaging`)."""
    k, owner, offset, start, width = layout_arrays(num_drafts, max_drafts)
    dev = torch.device(device)
    up = [upload_array(a, dev) for a in (k, owner, offset, start)]
    return SpecLayout(up[0], up[1], up[2], up[3], width)


def verify_inputs(last_token: torch.Tensor, drafts: torch.Tensor, lay: SpecLayout) -> torch.Tensor:
    """The forward's input ids [P]: each row's last token, then its drafts."""
    draft_at = drafts[lay.owner, (lay.offset - 1).clamp(min=0)] if drafts.shape[1] else last_token[lay.owner]
    return torch.where(lay.offset == 0, last_token[lay.owner], draft_at)


def expand_args(args: SamplingArgs, lay: SpecLayout) -> SamplingArgs:
    """Per-row args [n] -> per-position args [P]: position j samples output index + j."""
    o = lay.owner

    def pick(t):
        return None if t is None else t.index_select(0, o)

    draw = None
    if args.draw is not None:
        f = args.draw.filter
        draw = Draw(pick(args.draw.temperature), pick(args.draw.seed),
                    None if f is None else TopKTopP(pick(f.top_k), pick(f.top_p)))
    pen = None if args.penalties is None else Penalties(*(pick(t) for t in args.penalties))
    return SamplingArgs(pick(args.output_index) + lay.offset, draw=draw, penalties=pen,
                        min_tokens=pick(args.min_tokens), min_p=pick(args.min_p))


def expand_history(history: tuple[torch.Tensor, torch.Tensor, torch.Tensor], drafts: torch.Tensor,
                   lay: SpecLayout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rows' (output counts, prompt mask, stop mask) [n, V] at each position [P, V]: position j
    counts d1..dj as output too (they precede it; if one is rejected, j's sample is dropped anyway)."""
    counts, prompt, stop = (t.index_select(0, lay.owner) for t in history)
    if drafts.shape[1]:
        before = torch.arange(drafts.shape[1], device=drafts.device)[None, :] < lay.offset[:, None]  # [P, K]
        tokens = drafts.index_select(0, lay.owner)
        counts = counts.scatter_add(1, tokens.clamp(min=0), before.to(counts.dtype))
    return counts, prompt, stop


def target_tokens(logits: torch.Tensor, args: SamplingArgs, drafts: torch.Tensor, lay: SpecLayout,
                  history: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                  bitmask: torch.Tensor | None = None) -> torch.Tensor:
    """What non-speculative decoding samples at each position [P] (replay), from raw logits [P, V],
    the rows' args [n], their history [n, V] (when args.needs_history) and per-position masks [P, W]."""
    if history is not None:
        history = expand_history(history, drafts, lay)
    return sample_group(logits, expand_args(args, lay), history, bitmask)


class Verdict(NamedTuple):
    """A group's outcome, all on the device."""

    accepted: torch.Tensor  # [n] drafts accepted (0..k_i)
    tokens: torch.Tensor  # [n, K + 1] emitted tokens: the accepted drafts, then one more; NO_TOKEN after
    last: torch.Tensor  # [n] the last emitted token: the row's next input


def _padded(flat: torch.Tensor, lay: SpecLayout) -> torch.Tensor:
    out = torch.full((lay.num_drafts.shape[0], lay.max_drafts + 1), NO_TOKEN, dtype=flat.dtype, device=flat.device)
    out[lay.owner, lay.offset] = flat
    return out


def _verdict(accepted: torch.Tensor, tokens: torch.Tensor) -> Verdict:
    """Emitted tokens [n, K+1]: `tokens` up to and including column `accepted`."""
    cols = torch.arange(tokens.shape[1], device=tokens.device)[None, :]
    last = tokens.gather(1, accepted[:, None])[:, 0]
    return Verdict(accepted, tokens.masked_fill(cols > accepted[:, None], NO_TOKEN), last)


def leading_matches(drafts: torch.Tensor, tokens: torch.Tensor, num_drafts: torch.Tensor) -> torch.Tensor:
    """[n] how many of each row's first num_drafts drafts [n, K] equal `tokens` [n, >= K] in order."""
    k = drafts.shape[1]
    live = torch.arange(k, device=drafts.device)[None, :] < num_drafts[:, None]
    return ((drafts == tokens[:, :k]) & live).to(torch.int64).cumprod(1).sum(1)


def replay_accept(targets: torch.Tensor, drafts: torch.Tensor, lay: SpecLayout) -> Verdict:
    """Replay acceptance from `target_tokens`' samples [P]: the longest prefix of drafts equal to them."""
    # the same in numpy on the CPU: half the CPU time of torch's ops (tools/spec/bench_spec_cpu_paths.py)
    if targets.device.type == "cpu":
        return _replay_accept_numpy(targets, drafts, lay)
    return _replay_accept_torch(targets, drafts, lay)


def _replay_accept_torch(targets: torch.Tensor, drafts: torch.Tensor, lay: SpecLayout) -> Verdict:
    t = _padded(targets, lay)
    return _verdict(leading_matches(drafts, t, lay.num_drafts), t)


def _replay_accept_numpy(targets: torch.Tensor, drafts: torch.Tensor, lay: SpecLayout) -> Verdict:
    n, width = lay.num_drafts.shape[0], lay.max_drafts + 1
    t = np.full((n, width), NO_TOKEN, dtype=np.int64)
    t[lay.owner.numpy(), lay.offset.numpy()] = targets.numpy()
    d = drafts.numpy()
    k = d.shape[1]
    live = np.arange(k)[None, :] < lay.num_drafts.numpy()[:, None]
    accepted = ((d == t[:, :k]) & live).cumprod(1).sum(1)
    last = t[np.arange(n), accepted]
    t[np.arange(width)[None, :] > accepted[:, None]] = NO_TOKEN
    return Verdict(torch.from_numpy(accepted), torch.from_numpy(t), torch.from_numpy(last))


def _position_keys(seed: torch.Tensor, output_index: torch.Tensor, salt: int) -> torch.Tensor:
    return hash32(row_keys(seed, output_index) ^ salt)


def rejection_accept(logits: torch.Tensor, args: SamplingArgs, drafts: torch.Tensor, draft_probs: torch.Tensor | None,
                     lay: SpecLayout, history: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                     bitmask: torch.Tensor | None = None) -> Verdict:
    """Rejection sampling from raw logits [P, V] (with `target_tokens`' history and masks), the rows'
    args [n], drafts [n, K] and the distributions they were drawn from, draft_probs [n, K, V]; None:
    point drafts (q = 1 at the draft: accepted with probability p(d), else a draw from p without d,
    exact for drafts chosen any way that does not read this step's noise, e.g. n-gram). Greedy rows
    (temperature 0, or no draw) accept a draft equal to the argmax and emit the argmax. The noise
    of position j is keyed on (seed, output index + j); the bonus token after k acceptances is the
    draw non-speculative decoding makes at that index. It draws one row of noise per row, where
    replay draws one per position."""
    n, k = lay.num_drafts.shape[0], lay.max_drafts
    dev = logits.device
    pos_args = expand_args(args, lay)
    if history is not None:
        history = expand_history(history, drafts, lay)
    logits = process_group(logits, pos_args, history, bitmask)
    if pos_args.draw is None or args.draw is None:
        greedy_pos = torch.ones(logits.shape[0], dtype=torch.bool, device=dev)
        x, seed = logits, torch.zeros(n, dtype=torch.int64, device=dev)
    else:
        greedy_pos = pos_args.draw.temperature <= 0
        x, seed = draw_logits(logits, pos_args.draw), args.draw.seed
    argmax = x.argmax(-1)
    p = x.softmax(-1)  # (a greedy row's p is one-hot at argmax: written out where it is read)
    out0 = args.output_index
    cols = torch.arange(k, device=dev)
    # acceptance of d_{j+1} at position j, [n, K]: u * q(d) <= p(d), never for a token p excludes
    live = cols[None, :] < lay.num_drafts[:, None]
    at = torch.where(live, lay.start[:, None] + cols[None, :], lay.start[:, None]).reshape(-1)
    d = drafts.clamp(min=0)
    p_d = torch.where(greedy_pos[at], (argmax[at] == d.reshape(-1)).to(p.dtype),
                      p[at, d.reshape(-1)]).reshape(n, k)
    q_d = torch.ones_like(p_d) if draft_probs is None or not k else draft_probs.gather(2, d[:, :, None])[:, :, 0]
    u = uniforms(_position_keys(seed[:, None], out0[:, None] + cols[None, :], _ACCEPT_SALT).reshape(-1), 1)
    ok = (u.reshape(n, k) * q_d <= p_d) & (p_d > 0) & live
    accepted = ok.to(torch.int64).cumprod(1).sum(1)
    # the token after the accepted drafts: from the residual at a rejection, from p after all k
    nxt_at = lay.start + accepted
    rejected = accepted < lay.num_drafts
    p_at = p.index_select(0, nxt_at)
    if not k:
        residual = p_at
    elif draft_probs is None:  # max(p - one-hot(d), 0) is p without d
        d_at = d.gather(1, accepted.clamp(max=k - 1)[:, None])
        residual = p_at.scatter(1, d_at, 0.0)
    else:
        residual = (p_at - draft_probs[torch.arange(n, device=dev), accepted.clamp(max=k - 1)]).clamp(min=0)
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_at)  # p == q (to rounding)
    scores = torch.where(rejected[:, None], residual.log(), x.index_select(0, nxt_at))
    keys = torch.where(rejected, _position_keys(seed, out0 + accepted, _RESIDUAL_SALT),
                       row_keys(seed, out0 + accepted))
    g = uniforms(keys, x.shape[-1])
    drawn = (scores - (-g.log()).log()).argmax(-1)
    nxt = torch.where(greedy_pos.index_select(0, nxt_at), argmax.index_select(0, nxt_at), drawn)
    tokens = torch.cat([drafts, drafts.new_full((n, 1), NO_TOKEN)], 1)
    tokens = tokens.scatter(1, accepted[:, None], nxt[:, None])
    return _verdict(accepted, tokens)


def count_emitted(output_counts: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor) -> None:
    """After acceptance: output_counts[rows[i], t] += 1 for each emitted token t of tokens [n, K+1]
    (NO_TOKEN skipped), so the next step's penalties count exactly what was emitted."""
    valid = tokens >= 0
    output_counts.index_put_((rows[:, None].expand_as(tokens), tokens.clamp(min=0)),
                             valid.to(output_counts.dtype), accumulate=True)
