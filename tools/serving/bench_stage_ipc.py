"""What an output stage in another process would cost the loop, against the text phase in the loop.

    python tools/serving/bench_stage_ipc.py

Issue 14 asks for output processing beside the loop in "a thread or a process, measured both
ways". The thread variant exists (EngineConfig(output_stage="thread"), docs/benchmarks.md). This
measures the process variant's unavoidable part before building it: one pass of N requests with
one new token each (SmolLM2's tokenizer, ByteStreamDetokenizer), pickled to a child process that
detokenises and sends the texts back over a pipe. Columns: the text phase run in the loop (CPU
µs), the loop's own CPU for the process variant (pickle out + unpickle back), and the round trip
(how late the texts would be). Medians / means / p90 of 250 passes after 50 warm-up passes.
"""
import multiprocessing as mp
import pickle
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's slipstream
from slipstream.models.tokenizers.byte_stream import ByteStreamDetokenizer, byte_table
from slipstream.models.loading.gguf_loader import load_gguf_tokenizer
from slipstream.models.loading.loader import resolve_model_path

def child(conn, n):
    tok = load_gguf_tokenizer(resolve_model_path("smollm2-135m"))
    table = byte_table(tok)
    detoks = [ByteStreamDetokenizer(table) for _ in range(n)]
    conn.send("ready")
    while True:
        msg = conn.recv_bytes()
        if not msg: return
        work = pickle.loads(msg)
        conn.send_bytes(pickle.dumps([(rid, detoks[rid].push(toks)) for rid, toks in work]))

if __name__ == "__main__":
    from slipstream.provenance import header, provenance

    print(header(provenance()), flush=True)
    print("| N requests × 1 token | text phase in the loop: CPU µs median / mean / p90 | process stage: loop CPU µs "
          "(pickle out + unpickle in) | process stage: round trip µs |\n|---:|---:|---:|---:|")
    tok = load_gguf_tokenizer(resolve_model_path("smollm2-135m"))
    table = byte_table(tok)
    ids = tok.encode("The quick brown fox jumps over the lazy dog and keeps running far away. " * 40)
    for n in (128, 512):
        a, b = mp.Pipe()
        p = mp.get_context("spawn").Process(target=child, args=(b, n)); p.start(); a.recv()
        local = [ByteStreamDetokenizer(table) for _ in range(n)]
        rt, loop_cpu, inproc = [], [], []
        for step in range(300):
            work = [(r, [ids[(step + r) % len(ids)]]) for r in range(n)]
            c0 = time.thread_time(); t0 = time.perf_counter()
            a.send_bytes(pickle.dumps(work))
            c1 = time.thread_time()
            data = a.recv_bytes()
            c2 = time.thread_time()
            out = pickle.loads(data)
            t1 = time.perf_counter(); c3 = time.thread_time()
            rt.append((t1 - t0) * 1e6); loop_cpu.append(((c1 - c0) + (c3 - c2)) * 1e6)
            c0 = time.thread_time()
            texts = [(r, local[r].push(t)) for r, t in work]
            inproc.append((time.thread_time() - c0) * 1e6)
        a.send_bytes(b""); p.join()
        s = lambda xs: (f"{statistics.median(xs[50:]):.0f} / {statistics.fmean(xs[50:]):.0f} / "  # noqa: E731
                        f"{statistics.quantiles(xs[50:], n=10)[8]:.0f}")
        print(f"| {n} | {s(inproc)} | {s(loop_cpu)} | {s(rt)} |")
