"""``bench prefix``'s client against servers that fail: every request still gets a row saying what
happened (a timeout, an HTTP error), over real HTTP on 127.0.0.1."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from vericache_lab.bench import prefix_client


class Stalling(BaseHTTPRequestHandler):
    """Healthy and lists a model, but completions either never answer (``stall``) or fail with a 500."""
    stall = True

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        body = json.dumps({"data": [{"id": "m"}]} if self.path == "/v1/models" else {"status": "ok"}).encode()
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers["content-length"]))
        if self.stall:
            time.sleep(5)
            return
        body = b'{"error": {"message": "engine exploded"}}'
        self.send_response(500)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.mark.parametrize("stall", [True, False])
def test_failed_requests_get_rows_that_say_what_happened(tmp_path, capsys, stall):
    handler = type("Handler", (Stalling,), {"stall": stall})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        prompts = tmp_path / "prompts.json"
        prompts.write_text(json.dumps(["a", "b"]))
        t0 = time.perf_counter()
        prefix_client.main(f"http://127.0.0.1:{server.server_address[1]}", str(prompts), 4, timeout_s=1)
        assert time.perf_counter() - t0 < 4          # the timeout, not the server's 5 s stall
    finally:
        server.shutdown()
    rows = json.loads(capsys.readouterr().out)["requests"]
    assert len(rows) == 2
    for row in rows:
        assert row["status"] == ("timeout" if stall else 500) and row["ttft_s"] is None and row["e2e_s"] > 0
        assert ("no reply for 1 s" if stall else "engine exploded") in str(row["stats"]["error"])
