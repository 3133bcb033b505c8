"""Throughput and latency of a running `edgemoe serve` at several numbers of concurrent clients.

Each of C clients sends --requests streamed /v1/completions requests one after the other (greedy,
--max-tokens each, prompts taken in turn from a few Shakespeare openings); the server batches whatever
requests are in flight. For each C: total completion tokens per second of wall time, and per request
the time to first token (TTFT) and the whole latency; and the requests lost: refused, reset, or a
stream that did not end with a finish_reason and `data: [DONE]` (the command exits 1 if any was).

    edgemoe serve --port 8000 &
    python tools/bench_serve.py --url http://127.0.0.1:8000 [--concurrency 1,2,4,8] [--json]
    python tools/bench_serve.py --concurrency 64 --requests 1 --max-tokens 16    # a burst: is anything lost?
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import threading
import time
from urllib.parse import urlparse

PROMPTS = ["ROMEO:", "JULIET:\nO", "To be, or not to be", "KING.\nWhat", "HAMLET:\n", "Now is the winter",
           "Friends, Romans", "All the world"]


def one_request(host: str, port: int, prompt: str, max_tokens: int) -> dict:
    """Stream one completion; return its TTFT, latency (seconds) and completion token count."""
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}})
    conn = http.client.HTTPConnection(host, port, timeout=600)
    start = time.perf_counter()
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    response = conn.getresponse()
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}: {response.read()[:300]!r}")
    ttft, tokens, finish_reason, done = None, None, None, False
    for line in response:
        if line.strip() == b"data: [DONE]":
            done = True
        if not line.startswith(b"data: ") or done:
            continue
        event = json.loads(line[6:])
        if "error" in event:
            raise RuntimeError(f"server error: {event['error']}")
        if ttft is None and event["choices"] and event["choices"][0]["text"]:
            ttft = time.perf_counter() - start
        if event["choices"]:
            finish_reason = event["choices"][0]["finish_reason"] or finish_reason
        if event.get("usage"):
            tokens = event["usage"]["completion_tokens"]
    latency = time.perf_counter() - start
    conn.close()
    if not done or finish_reason is None:
        raise RuntimeError(f"stream cut short (finish_reason {finish_reason}, [DONE] {'seen' if done else 'missing'})")
    return {"ttft_s": ttft if ttft is not None else latency, "latency_s": latency, "tokens": tokens or 0}


def run_level(host: str, port: int, clients: int, requests: int, max_tokens: int) -> dict:
    results: list[dict] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def client(index: int) -> None:
        try:
            for r in range(requests):
                result = one_request(host, port, PROMPTS[(index + r) % len(PROMPTS)], max_tokens)
                with lock:
                    results.append(result)
        except Exception as e:   # counted as lost, reported after the run: one failing client must not stop the rest
            errors.append(e)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    if not results:
        raise RuntimeError(f"every request of {clients} clients failed, the first with: {errors[0]!r}")
    latencies = sorted(r["latency_s"] for r in results)
    tokens = sum(r["tokens"] for r in results)
    return {"clients": clients, "requests": len(results), "lost": len(errors),
            "first_error": repr(errors[0]) if errors else None, "completion_tokens": tokens, "wall_s": wall,
            "total_tok_s": tokens / wall,
            "ttft_s_median": statistics.median(r["ttft_s"] for r in results),
            "latency_s_median": statistics.median(latencies), "latency_s_max": latencies[-1],
            "per_request_tok_s_median": statistics.median(r["tokens"] / r["latency_s"] for r in results)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--concurrency", default="1,2,4,8", help="comma-separated client counts")
    parser.add_argument("--requests", type=int, default=3, help="requests per client, one after the other")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    url = urlparse(args.url)
    host, port = url.hostname or "127.0.0.1", url.port or 80
    one_request(host, port, PROMPTS[0], 4)        # warm-up: first-use costs stay out of the figures
    rows = [run_level(host, port, int(c), args.requests, args.max_tokens) for c in args.concurrency.split(",")]
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print(f"{'clients':>7} {'requests':>8} {'lost':>4} {'tokens':>7} {'total tok/s':>11} {'TTFT med s':>10} "
              f"{'latency med s':>13} {'latency max s':>13} {'tok/s per req':>13}")
        for r in rows:
            print(f"{r['clients']:>7} {r['requests']:>8} {r['lost']:>4} {r['completion_tokens']:>7} "
                  f"{r['total_tok_s']:>11.1f} {r['ttft_s_median']:>10.3f} {r['latency_s_median']:>13.2f} "
                  f"{r['latency_s_max']:>13.2f} {r['per_request_tok_s_median']:>13.1f}")
    for r in rows:
        if r["lost"]:
            print(f"{r['clients']} clients: {r['lost']} requests lost, the first: {r['first_error']}", file=sys.stderr)
    sys.exit(1 if any(r["lost"] for r in rows) else 0)


if __name__ == "__main__":
    main()
