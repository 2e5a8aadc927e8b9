"""tools/peers/llamacpp_server_bench.py against a stand-in server that streams like llama-server's /completion."""
import importlib.util
import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

_path = os.path.join(os.path.dirname(__file__), "..", "tools", "peers", "llamacpp_server_bench.py")
_spec = importlib.util.spec_from_file_location("llamacpp_server_bench", _path)
server_bench = importlib.util.module_from_spec(_spec)
sys.modules["llamacpp_server_bench"] = server_bench
_spec.loader.exec_module(server_bench)


class _Streamer(BaseHTTPRequestHandler):
    seen: list = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.seen.append(body)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        time.sleep(0.02)  # "prefill"
        for i in range(body["n_predict"]):
            last = i == body["n_predict"] - 1
            self.wfile.write(f"data: {json.dumps({'tokens': [7], 'content': '', 'stop': last})}\n\n".encode())
            self.wfile.flush()
            time.sleep(0.005)

    def log_message(self, *args):
        pass


def test_a_round_counts_streamed_tokens_and_times_them():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Streamer)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        r = server_bench.one_round(srv.server_port, server_bench.prompt_ids(3, 4), 6)
    finally:
        srv.shutdown()
    assert r["ttft_ms"] >= 20 and r["itl_ms"] >= 5 and r["tok_s"] > 0
    body = _Streamer.seen[-1]  # greedy, exact length, streamed, token ids as the prompt
    assert body["ignore_eos"] and body["top_k"] == 1 and body["stream"] and body["n_predict"] == 6
    assert isinstance(body["prompt"], list) and len(body["prompt"]) == 4


def test_a_short_answer_is_an_error():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Streamer)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        orig = server_bench.one_request

        def short(port, prompt, length, t0, out):  # the server stops one token early
            orig(port, prompt, length - 1, t0, out)

        server_bench.one_request = short
        with pytest.raises(RuntimeError, match="tokens, not 6"):
            server_bench.one_round(srv.server_port, server_bench.prompt_ids(2, 4), 6)
    finally:
        server_bench.one_request = orig
        srv.shutdown()
