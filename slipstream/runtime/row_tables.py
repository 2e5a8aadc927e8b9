"""The per-row device tables logit processing reads (slipstream/runtime/logits_process.py).

One row per batch row (the runner's carry-over row), kept on the device for the life of the
sequence that owns it:

    output_counts [R, V] int32   tokens sampled so far, counted (frequency / presence / repetition)
    prompt_mask   [R, V] bool    tokens of the prompt (repetition)
    stop_mask     [R, V] bool    EOS and stop_token_ids (min_tokens)

Memory: R × V × 6 bytes (32 rows × 49,152 tokens: 9.4 MB; 256 × 152,064: 234 MB), so a runner
may allocate them on first use. `admit` writes a row when a sequence takes it (or comes back
after a preemption, with its output so far); `record` runs right after sampling on the same
stream, so the next step's penalties see the token just drawn without a host round trip.
"""
from __future__ import annotations

import torch

from slipstream.runtime.logits_process import flat_rows, record_sampled, reset_rows


class RowTables:
    def __init__(self, max_rows: int, vocab_size: int, device: torch.device | str):
        self.device = torch.device(device)
        self.output_counts = torch.zeros(max_rows, vocab_size, dtype=torch.int32, device=self.device)
        self.prompt_mask = torch.zeros(max_rows, vocab_size, dtype=torch.bool, device=self.device)
        self.stop_mask = torch.zeros(max_rows, vocab_size, dtype=torch.bool, device=self.device)

    def admit(self, rows: list[int], prompts: list[list[int]], outputs: list[list[int]],
              stops: list[list[int]]) -> None:
        """Rows taken by sequences (host lists; one small upload per list): clear, then fill."""
        p_ids, p_rows = flat_rows(rows, prompts, self.device)
        o_ids, o_rows = flat_rows(rows, outputs, self.device)
        s_ids, s_rows = flat_rows(rows, stops, self.device)
        index = torch.tensor(rows, dtype=torch.int64, device=self.device)
        reset_rows(self.output_counts, self.prompt_mask, self.stop_mask, index, p_ids, p_rows, o_ids, o_rows,
                   s_ids, s_rows)

    def record(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        """After sampling (device tensors [n]): count each row's new token."""
        record_sampled(self.output_counts, rows, tokens)

    def gather(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The group's rows of (output_counts, prompt_mask, stop_mask), [n, V] each."""
        return (self.output_counts.index_select(0, rows), self.prompt_mask.index_select(0, rows),
                self.stop_mask.index_select(0, rows))
