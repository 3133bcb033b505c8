"""Latency of a short JSON request on loopback for the two HTTP stacks edgemoe serve could use: the
standard library's ThreadingHTTPServer and uvicorn + starlette (ASGI). Each stack runs in its own
process with a handler that reads a small JSON body and answers a completion-sized JSON; the client
(http.client, one keep-alive connection, or a new connection per request) times round trips.

    python tools/bench_http_stacks.py [--requests 2000] [--json]

The ASGI stack needs `pip install uvicorn starlette` (or PYTHONPATH pointing at them); it is
skipped, with a note, if they cannot be imported.
"""

from __future__ import annotations

import argparse
import http.client
import json
import socket
import statistics
import subprocess
import sys
import time

ANSWER = json.dumps({"id": "cmpl-0", "object": "text_completion", "created": 0, "model": "m",
                     "choices": [{"index": 0, "text": "x" * 64, "logprobs": None, "finish_reason": "length"}],
                     "usage": {"prompt_tokens": 5, "completion_tokens": 16, "total_tokens": 21}}).encode()
BODY = json.dumps({"model": "m", "prompt": "ROMEO:", "max_tokens": 16, "temperature": 0}).encode()


def serve_stdlib(port: int) -> None:
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self):
            json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(ANSWER)))
            self.end_headers()
            self.wfile.write(ANSWER)

        def setup(self):
            super().setup()   # as edgemoe/server.py: no Nagle delay between headers and body
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def log_message(self, *args):
            pass

    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()


def serve_asgi(port: int) -> None:
    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import Response
    from starlette.routing import Route

    async def completions(request):
        json.loads(await request.body())
        return Response(ANSWER, media_type="application/json")

    app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(port: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"no server on port {port} after {timeout} s")


def time_requests(port: int, n: int, keep_alive: bool) -> list[float]:
    """Round-trip seconds of n POSTs (after 50 unmeasured ones)."""
    conn = http.client.HTTPConnection("127.0.0.1", port)
    times = []
    for i in range(n + 50):
        if not keep_alive:
            conn.close()
            conn = http.client.HTTPConnection("127.0.0.1", port)
        start = time.perf_counter()
        conn.request("POST", "/v1/completions", BODY, {"Content-Type": "application/json"})
        response = conn.getresponse()
        response.read()
        if i >= 50:
            times.append(time.perf_counter() - start)
    conn.close()
    return times


def bench(stack: str, n: int) -> list[dict]:
    port = free_port()
    server = subprocess.Popen([sys.executable, __file__, "--serve", stack, "--port", str(port)])
    try:
        wait_for(port)
        rows = []
        for keep_alive in (True, False):
            times = sorted(time_requests(port, n, keep_alive))
            rows.append({"stack": stack, "connection": "keep-alive" if keep_alive else "new per request",
                         "requests": n, "median_ms": 1e3 * statistics.median(times),
                         "p99_ms": 1e3 * times[int(0.99 * (len(times) - 1))]})
        return rows
    finally:
        server.terminate()
        server.wait()


def asgi_available() -> bool:
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
        return True
    except ImportError:
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--serve", choices=["stdlib", "asgi"], help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        (serve_stdlib if args.serve == "stdlib" else serve_asgi)(args.port)
        return
    rows = bench("stdlib", args.requests)
    if asgi_available():
        rows += bench("asgi", args.requests)
    else:
        print("uvicorn/starlette not importable: ASGI stack skipped", file=sys.stderr)
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"{'stack':8} {'connection':18} {'requests':>8} {'median ms':>10} {'p99 ms':>8}")
    for r in rows:
        print(f"{r['stack']:8} {r['connection']:18} {r['requests']:>8} {r['median_ms']:>10.3f} {r['p99_ms']:>8.3f}")


if __name__ == "__main__":
    main()
