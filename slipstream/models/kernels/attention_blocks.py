"""The paged-attention kernel's query blocks, on the host: how many programs a step needs and the
[2, P] program table of the flat grid (attention_triton.py says what the kernel does with it).

Plain numpy, apart from the kernel, so the fixed-shape step layout (runtime/graphs/static_step.py) builds
its tables on any install: the reference backend never imports triton.
"""
import numpy as np

BLOCK_M = 16  # queries per program; tl.dot needs every dim >= 16
PAST_END = 1 << 30  # block start of an unused program-table entry: past any q_len, so it exits


def num_query_programs(tokens: int, seqs: int) -> int:
    """Programs (per head) that cover every query block of any step of <= `tokens` tokens in <= `seqs`
    sequences: sum(ceil(q_s / B)) <= sum(floor(q_s / B)) + #(q_s > 0) <= tokens // B + seqs."""
    return tokens // BLOCK_M + seqs


def query_blocks(q_lens: np.ndarray, num_programs: int) -> np.ndarray:
    """The [2, num_programs] int64 program table for sequences of these query lengths: (sequence,
    first query) of each BLOCK_M block in order, then unused entries (sequence 0, PAST_END)."""
    q_lens = np.asarray(q_lens, np.int64)
    per_seq = -(-q_lens // BLOCK_M)
    total = int(per_seq.sum())
    if total > num_programs:
        raise ValueError(f"{total} query blocks exceed the {num_programs} programs of the table")
    table = np.empty((2, num_programs), np.int64)
    table[0, total:], table[1, total:] = 0, PAST_END
    table[0, :total] = np.repeat(np.arange(len(q_lens)), per_seq)
    first_of_seq = np.repeat(np.cumsum(per_seq) - per_seq, per_seq)
    table[1, :total] = (np.arange(total) - first_of_seq) * BLOCK_M
    return table
