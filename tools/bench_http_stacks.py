"""Latency of a short JSON request on loopback for the two HTTP stacks edgemoe serve could use: the
standard library's ThreadingHTTPServer and uvicorn + starlette (ASGI). Each stack runs in its own
process with a handler that reads a small JSON body and answers a completion-sized JSON; C client
threads (http.client, each on one keep-alive connection or a new connection per request) send the
requests between them and time round trips: requests per second of wall time, median and p99.

    python tools/bench_http_stacks.py [--requests 2000] [--clients 1,16,64] [--json]

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
from concurrent.futures import ThreadPoolExecutor

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

    class Server(ThreadingHTTPServer):
        request_queue_size = 2048   # as edgemoe/server.py: the default 5 resets connections of a burst

    Server(("127.0.0.1", port), Handler).serve_forever()


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


def time_requests(port: int, n: int, keep_alive: bool, warmup: int = 0) -> list[float]:
    """Round-trip seconds of n POSTs from one client (after `warmup` unmeasured ones)."""
    conn = http.client.HTTPConnection("127.0.0.1", port)
    times = []
    for i in range(n + warmup):
        if not keep_alive:
            conn.close()
            conn = http.client.HTTPConnection("127.0.0.1", port)
        start = time.perf_counter()
        conn.request("POST", "/v1/completions", BODY, {"Content-Type": "application/json"})
        response = conn.getresponse()
        response.read()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    conn.close()
    return times


def time_clients(port: int, n: int, keep_alive: bool, clients: int) -> tuple[list[float], float]:
    """(round-trip seconds, wall seconds) of n POSTs shared by `clients` concurrent clients, after 50
    unmeasured ones from one."""
    time_requests(port, 0, keep_alive, warmup=50)
    with ThreadPoolExecutor(clients) as pool:
        start = time.perf_counter()
        per_client = list(pool.map(lambda _: time_requests(port, n // clients, keep_alive), range(clients)))
        wall = time.perf_counter() - start
    return [t for times in per_client for t in times], wall


def bench(stack: str, n: int, clients: list[int]) -> list[dict]:
    port = free_port()
    server = subprocess.Popen([sys.executable, __file__, "--serve", stack, "--port", str(port)])
    try:
        wait_for(port)
        rows = []
        for c in clients:
            for keep_alive in (True, False):
                times, wall = time_clients(port, n, keep_alive, c)
                times.sort()
                rows.append({"stack": stack, "connection": "keep-alive" if keep_alive else "new per request",
                             "clients": c, "requests": len(times), "requests_per_s": len(times) / wall,
                             "median_ms": 1e3 * statistics.median(times),
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
    parser.add_argument("--requests", type=int, default=2000, help="measured requests per row, all clients together")
    parser.add_argument("--clients", default="1", help="comma-separated numbers of concurrent clients")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--serve", choices=["stdlib", "asgi"], help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        (serve_stdlib if args.serve == "stdlib" else serve_asgi)(args.port)
        return
    clients = [int(c) for c in args.clients.split(",")]
    rows = bench("stdlib", args.requests, clients)
    if asgi_available():
        rows += bench("asgi", args.requests, clients)
    else:
        print("uvicorn/starlette not importable: ASGI stack skipped", file=sys.stderr)
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"{'stack':8} {'connection':18} {'clients':>7} {'requests':>8} {'req/s':>8} {'median ms':>10} {'p99 ms':>8}")
    for r in rows:
        print(f"{r['stack']:8} {r['connection']:18} {r['clients']:>7} {r['requests']:>8} {r['requests_per_s']:>8.0f} "
              f"{r['median_ms']:>10.3f} {r['p99_ms']:>8.3f}")


if __name__ == "__main__":
    main()
