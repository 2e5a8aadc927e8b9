"""Each row's tokens by position, on the device: what drafters that look back (n-gram) read.

tokens[row, p] is the token at position p of the row's sequence (prompt, then emitted output);
length[row] is how many are known: the newest emitted token sits at length - 1, which is the row's
next input position (RowTables.pos). Written on the compute stream like the row tables: a chunk's
known tokens before the forward that feeds them, a step's emitted tokens after its acceptance, so
the next proposal sees them without a host round trip. Every step writes its own inputs at its start
(`write_inputs`, inside the forward and so inside a plain step's graph: no launch of its own); a
speculating step writes them before its proposal and its emitted run after its acceptance. So when a
step starts, each of its rows' history holds the row's tokens through its input token. Column `max_len` is a sink that padding
writes go to, so no two writes of a step land on one live entry (duplicate scatter indices are
undefined on a device).
"""
from __future__ import annotations

import torch

NO_TOKEN = -1  # before position 0 and past length: matches no token id


class TokenHistory:
    def __init__(self, max_rows: int, max_len: int, device: torch.device | str = "cpu"):
        self.max_len = max_len
        self.tokens = torch.full((max_rows, max_len + 1), NO_TOKEN, dtype=torch.int32, device=device)
        self.length = torch.zeros(max_rows, dtype=torch.int64, device=device)

    def write_chunks(self, token_rows: torch.Tensor, positions: torch.Tensor, tokens: torch.Tensor,
                     chunk_rows: torch.Tensor, chunk_ends: torch.Tensor) -> None:
        """Known tokens [T] of prompt chunks (or a recompute) at their positions; each chunk's row's
        length becomes its end (a recompute from position 0 shortens it). One chunk per row."""
        self.tokens[token_rows, positions] = tokens.to(self.tokens.dtype)
        self.length[chunk_rows] = chunk_ends

    def write_inputs(self, token_rows: torch.Tensor, positions: torch.Tensor, ids: torch.Tensor,
                     seq_rows: torch.Tensor, seq_lens: torch.Tensor) -> None:
        """A step's input tokens [T] (decode rows' last tokens, chunk tokens) at their positions, and
        each sequence's length: its context length through this step's inputs (a recompute from 0
        shortens it). Padding writes row 0 (the scratch row, read by no drafter)."""
        self.tokens[token_rows, positions] = ids.to(self.tokens.dtype)
        self.length.index_copy_(0, seq_rows, seq_lens)

    def append(self, rows: torch.Tensor, tokens: torch.Tensor, counts: torch.Tensor) -> None:
        """Each row's first counts[i] tokens of tokens [n, w] (emitted by a step) after its length."""
        cols = torch.arange(tokens.shape[1], device=tokens.device)[None, :]
        at = self.length[rows][:, None] + cols
        at = torch.where((cols < counts[:, None]) & (at < self.max_len), at, self.max_len)  # the rest: sink
        self.tokens[rows[:, None].expand_as(at), at] = tokens.to(self.tokens.dtype)
        self.length[rows] = (self.length[rows] + counts).clamp(max=self.max_len)

    def window(self, rows: torch.Tensor, width: int) -> torch.Tensor:
        """[n, width] the last `width` tokens of each row, oldest first; NO_TOKEN before position 0."""
        at = self.length[rows][:, None] - width + torch.arange(width, device=rows.device)[None, :]
        out = self.tokens[rows[:, None].expand_as(at), at.clamp(min=0)].to(torch.int64)
        return out.masked_fill(at < 0, NO_TOKEN)
