"""Speed on a busy machine: each command's work on the bundled model, idle and next to one competing
busy process, with the default thread count (auto) and fixed ones.

    python tools/bench_busy.py [--repeats 3] [--json]

Workloads (each in a fresh process, so that auto mode looks at the machine as a new command would):
  decode   5 greedy generations of 200 tokens from "ROMEO:" (tokens/s)
  eval     perplexity over the first 6 windows of eval.txt (windows/s)
  convert  the bundled checkpoint to an INT4 store, no profile (1/s)
Conditions: idle; "busy from start": a pure-Python busy loop running before the command starts;
"busy later": the loop starts 1 s after the command, so only re-measuring (every 2 s) can see it.
Prints each workload's speed as a ratio to its idle speed with the same threads. Run it on an
otherwise idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

WORKLOADS = ("decode", "eval", "convert")
THREADS = ("auto", "1", "2")
CONDITIONS = ("idle", "busy from start", "busy later")
BUSY_LOOP = "while True: pass"


def work(workload: str, threads: int | None) -> float:
    """Run one workload in this process; returns its speed (units per second)."""
    import edgemoe
    from edgemoe.bundled import bundled_model_path, bundled_text
    from edgemoe.evaluate import evaluate

    path = bundled_model_path()
    if workload == "convert":
        from edgemoe.convert import convert
        from edgemoe.threads import set_command_threads
        with tempfile.TemporaryDirectory() as tmp:
            start = time.perf_counter()
            convert(path, os.path.join(tmp, "s"), bits=4, workers=set_command_threads(threads))   # as the CLI
            return 1 / (time.perf_counter() - start)
    model = edgemoe.load(path, threads=threads)
    if workload == "decode":
        model.generate("ROMEO:", max_new_tokens=8, temperature=0)   # warm-up
        start = time.perf_counter()
        tokens = sum(len(model.tokenizer.encode(model.generate("ROMEO:", max_new_tokens=200, temperature=0,
                                                               stop_token_ids=[]), add_special_tokens=False))
                     for _ in range(5))
        return tokens / (time.perf_counter() - start)
    ids = model.tokenizer.encode(bundled_text("eval.txt").read_text(), add_special_tokens=False)[:6 * 256 + 1]
    start = time.perf_counter()
    evaluate(model, ids, context=256, stride=256)
    return 6 / (time.perf_counter() - start)


def measure(workload: str, threads: str, condition: str) -> float:
    busy = None
    if condition == "busy from start":
        busy = subprocess.Popen([sys.executable, "-c", BUSY_LOOP])
        time.sleep(0.5)
    args = [sys.executable, __file__, "--worker", workload, "--threads", threads]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)
    if condition == "busy later":
        time.sleep(1.0)
        busy = subprocess.Popen([sys.executable, "-c", BUSY_LOOP])
    out = proc.communicate()[0]
    if busy is not None:
        busy.kill()
        busy.wait()
    if proc.returncode:
        raise SystemExit(f"{workload} with --threads {threads} failed")
    return float(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--worker", choices=WORKLOADS, help=argparse.SUPPRESS)
    parser.add_argument("--threads", default="auto", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(work(args.worker, None if args.threads == "auto" else int(args.threads)))
        return
    print(f"machine: {os.cpu_count()} cores, load average before: {os.getloadavg()[0]:.2f}", file=sys.stderr)
    speeds: dict = {}
    for _ in range(args.repeats):   # conditions interleaved, so that drift hits all alike
        for workload in WORKLOADS:
            for threads in THREADS:
                for condition in CONDITIONS:
                    speeds.setdefault((workload, threads, condition), []).append(measure(workload, threads, condition))
    rows = []
    for workload in WORKLOADS:
        for threads in THREADS:
            idle = statistics.median(speeds[(workload, threads, "idle")])
            row = {"workload": workload, "threads": threads, "idle": idle}
            for condition in CONDITIONS[1:]:
                row[condition] = statistics.median(speeds[(workload, threads, condition)]) / idle
            rows.append(row)
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    auto_idle = {r["workload"]: r["idle"] for r in rows if r["threads"] == "auto"}
    print(f"{'workload':9} {'threads':>7} {'idle speed':>11} {'vs auto idle':>12} "
          f"{'busy from start':>16} {'busy later':>11}   (ratios: speed / the same threads' idle speed)")
    for r in rows:
        print(f"{r['workload']:9} {r['threads']:>7} {r['idle']:11.2f} {r['idle'] / auto_idle[r['workload']]:12.2f} "
              f"{r['busy from start']:16.2f} {r['busy later']:11.2f}")


if __name__ == "__main__":
    main()
