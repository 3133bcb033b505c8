"""Where a served workload's time and CPU go: over HTTP or to the engine alone, with the engine's loop
on the thread that loaded the model or on a thread of its own; rounds of the four alternated in one
process on one loaded model (loaded as `edgemoe serve` loads it: --ram auto, --dense-bits auto).

The workload is tools/bench_serve.py's: C clients, each sending R greedy requests of --max-tokens one
after the other (so requests join while others decode), prompts taken in turn from a few Shakespeare
openings. Served two ways:

  engine  the clients are threads of this process that submit to an Engine and wait on their
          requests' events (what the server's handler threads do, without HTTP);
  http    an OpenAIServer in this process (`edgemoe serve`'s), the clients a separate process
          (tools/bench_serve.py) streaming over loopback;

and the loop (Engine.run, or OpenAIServer.serve_forever, which runs it) on this process's main
thread, which loaded the model, as `edgemoe serve` runs it ("loading thread"), or on a thread of
its own, as the server ran it before ("own thread").

Per round: completion tokens per second, the steps the engine ran (so tokens / steps is the mean
requests a step decoded), and CPU seconds (user + system) of the engine's thread, of the compute
pools (the threads that are not Python's: numba's and torch's OpenMP workers, which run a kernel's
parallel regions beside the engine's thread), of this process's other threads (http: the handler
threads and the accept loop; engine: the client threads), and of the client process (http only; it
includes its start and its one warm-up request of 4 tokens).

    python tools/bench_serve_cpu.py STORE --clients 8 --requests 3 --max-tokens 64 --rounds 3 --threads 2
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

import edgemoe
from edgemoe.engine import Engine
from edgemoe.generate import GenerationOptions
from edgemoe.server import OpenAIServer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serve import PROMPTS  # noqa: E402

TICKS = os.sysconf("SC_CLK_TCK")


def thread_cpu() -> dict[int, float]:
    """CPU seconds (user + system) of each live thread of this process, by its native id."""
    seconds = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            stat = Path(f"/proc/self/task/{tid}/stat").read_text()
        except FileNotFoundError:      # ended since the listing
            continue
        fields = stat[stat.rindex(")") + 2:].split()   # from field 3 (state); utime, stime are 14, 15
        seconds[int(tid)] = (int(fields[11]) + int(fields[12])) / TICKS
    return seconds


def usage_seconds(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


class StepCounter:
    """Counts an engine's steps that did work from now on, and notes the thread that runs them (the
    engine's loop calls engine.step() each turn)."""

    def __init__(self, engine: Engine):
        self.steps, self.thread_id, step = 0, None, engine.step

        def counted() -> bool:
            self.thread_id = threading.get_native_id()
            worked = step()
            self.steps += worked
            return worked

        engine.step = counted


class CPUAccount:
    """CPU seconds spent between start() and stop(), split as the module docstring says."""

    def start(self) -> "CPUAccount":
        self.threads, self.process = thread_cpu(), usage_seconds(resource.RUSAGE_SELF)
        self.children = usage_seconds(resource.RUSAGE_CHILDREN)
        return self

    def stop(self, engine_thread_id: int) -> dict[str, float]:
        threads, process = thread_cpu(), usage_seconds(resource.RUSAGE_SELF)
        python_ids = {t.native_id for t in threading.enumerate()}
        spent = {tid: seconds - self.threads.get(tid, 0.0) for tid, seconds in threads.items()}
        engine = spent.get(engine_thread_id, 0.0)
        pools = sum(seconds for tid, seconds in spent.items() if tid not in python_ids)
        return {"engine_thread_s": engine, "compute_pools_s": pools,
                "other_threads_s": process - self.process - engine - pools,   # ended threads included
                "client_process_s": usage_seconds(resource.RUSAGE_CHILDREN) - self.children}


def on_this_thread(run_loop, drive, measure, stop) -> None:
    """The loop on this thread (the one that loaded the model) while drive() runs on another; then
    measure(), and stop()."""
    def driver() -> None:
        try:
            drive()
            measure()
        finally:
            stop()

    helper = threading.Thread(target=driver)
    helper.start()
    run_loop()
    helper.join()


def on_its_own_thread(run_loop, drive, measure, stop) -> None:
    """The loop on a thread of its own (as the server ran it before), drive() on this one; then
    measure() (while that thread lives: an ended thread's CPU time is no longer listed), and stop()."""
    loop = threading.Thread(target=run_loop, name="edgemoe-engine")
    loop.start()
    try:
        drive()
        measure()
    finally:
        stop()
        loop.join()


def engine_round(model, clients: int, requests: int, max_tokens: int, placement) -> dict:
    """The workload against an Engine, its clients threads of this process."""
    engine = Engine(model)
    counter = StepCounter(engine)
    options = GenerationOptions(max_new_tokens=max_tokens, temperature=0.0)
    tokens = []

    def client(index: int) -> None:
        for r in range(requests):
            request = engine.submit(model.tokenizer.encode(PROMPTS[(index + r) % len(PROMPTS)]), options)
            for event in request.events():
                pass
            tokens.append(len(request.output_ids))

    def drive() -> None:
        threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    account, measured = CPUAccount().start(), {}
    start = time.perf_counter()
    placement(engine.run, drive, lambda: measured.update(wall_s=time.perf_counter() - start,
                                                         **account.stop(counter.thread_id)), engine.stop)
    engine.close()
    return {"completion_tokens": sum(tokens), "steps": counter.steps, **measured}


def http_round(model, clients: int, requests: int, max_tokens: int, placement) -> dict:
    """The workload over HTTP: an OpenAIServer here, tools/bench_serve.py as the client process."""
    server = OpenAIServer(model, port=0)
    counter = StepCounter(server.engine)
    done = []

    def drive() -> None:
        done.append(subprocess.run([sys.executable, str(Path(__file__).resolve().parent / "bench_serve.py"),
                                    "--url", server.url, "--concurrency", str(clients), "--requests",
                                    str(requests), "--max-tokens", str(max_tokens), "--json"],
                                   capture_output=True, text=True, check=True))

    account, cpu = CPUAccount().start(), {}
    placement(server.serve_forever, drive, lambda: cpu.update(account.stop(counter.thread_id)), server.shutdown)
    server.server_close()
    level = json.loads(done[0].stdout)[0]
    return {"wall_s": level["wall_s"], "completion_tokens": level["completion_tokens"], "lost": level["lost"],
            "steps": counter.steps, **cpu}


MODES = {"engine, loading thread": (engine_round, on_this_thread),
         "engine, own thread": (engine_round, on_its_own_thread),
         "http, loading thread": (http_round, on_this_thread),
         "http, own thread": (http_round, on_its_own_thread)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("store")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests", type=int, default=3, help="requests per client, one after the other")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if min(args.clients, args.requests, args.max_tokens, args.rounds) < 1:
        parser.error("--clients, --requests, --max-tokens and --rounds must be at least 1")
    model = edgemoe.load(args.store, threads=args.threads, ram="auto", dense_bits="auto")   # as serve loads it
    engine_round(model, args.clients, 1, 8, on_this_thread)   # warm-up: first-use costs stay out
    print(f"{'round':>5} {'mode':>22} {'tok/s':>6} {'tokens':>6} {'steps':>5} {'wall s':>6} {'engine thr s':>12} "
          f"{'pools s':>7} {'other thr s':>11} {'client s':>8}", flush=True)
    for round_ in range(1, args.rounds + 1):
        for mode, (serve_round, placement) in MODES.items():
            r = serve_round(model, args.clients, args.requests, args.max_tokens, placement)
            print(f"{round_:>5} {mode:>22} {r['completion_tokens'] / r['wall_s']:>6.1f} {r['completion_tokens']:>6} "
                  f"{r['steps']:>5} {r['wall_s']:>6.1f} {r['engine_thread_s']:>12.1f} {r['compute_pools_s']:>7.1f} "
                  f"{r['other_threads_s']:>11.1f} {r['client_process_s']:>8.1f}", flush=True)

if __name__ == "__main__":
    main()
