"""edgemoe against llama.cpp inside cgroup memory limits (page cache counted), interleaved rounds.

A model larger than the memory it may use: llama.cpp maps its GGUF and the kernel evicts and faults
its pages back in at the limit; edgemoe reads experts from its store into a RAM tier sized inside
the limit. For each pair STORE=GGUF (the same checkpoint, an INT4 store and Q4_0) and each --limit,
each round runs, one after the other in fresh cgroup v1 groups, with both programs' files dropped
from the page cache first:

- llama-bench: --llama-gen tokens decoded after an empty prompt, 2 repetitions (`-p 0 -n N -r 2`)
  and the flags in --llama-flags (default `--repack 0`: repacking copies every weight into
  anonymous memory, which no such limit holds);
- `edgemoe bench STORE --memory-limit LIMIT --ram RAM --cold` once per --mode (default: on-demand-lru
  and predictive, the default scheme), each in a process of its own, as a user's run is: --prefill
  tokens, then --warmup-tokens and --decode-tokens timed tokens.

    python tools/bench_limits_vs_llamacpp.py --llama-bench PATH/llama-bench --threads 2 --rounds 2 \\
        --pair STORE=MODEL-Q4_0.gguf --limit 640MiB 1GiB [--ram auto] [--json OUT]

Prints, per limit, each program's decode tokens/s per round (0 where the run was killed or failed,
with its exit status) and the groups' peak charge, then the medians over the rounds that finished,
how many did not, and edgemoe's ratio to llama.cpp.
Needs Linux, root and a cgroup v1 memory controller at /sys/fs/cgroup/memory.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_vs_llamacpp import cpu_summary  # noqa: E402

from edgemoe.bench import CGROUP_V1_MEMORY, remove_memory_group  # noqa: E402
from edgemoe.options import parse_bytes  # noqa: E402
from edgemoe.store.disk import drop_page_cache  # noqa: E402


def run_in_group(limit: int, argv: list[str]) -> tuple[subprocess.CompletedProcess, int, int]:
    """argv in a fresh cgroup v1 memory group of `limit` bytes: (the finished process, the group's peak
    charge in bytes, how often it hit the limit)."""
    group = CGROUP_V1_MEMORY / f"edgemoe-bench-limits-{os.getpid()}"
    group.mkdir()
    try:
        (group / "memory.limit_in_bytes").write_text(str(limit))
        done = subprocess.run(["bash", "-c", f'echo $$ > {group}/cgroup.procs && exec "$@"', "bash", *argv],
                              capture_output=True, text=True)
        peak = int((group / "memory.max_usage_in_bytes").read_text())
        return done, peak, int((group / "memory.failcnt").read_text())
    finally:
        remove_memory_group(group)


def llama_run(args, gguf: Path, limit: int) -> dict:
    """llama-bench's decode tokens/s inside the limit (0.0 when it failed), its exit status and peak."""
    drop_page_cache(gguf)
    argv = [args.llama_bench, "-m", str(gguf), "-t", str(args.threads), "-p", "0", "-n", str(args.llama_gen),
            "-r", "2", "-o", "jsonl", *args.llama_flags.split()]
    done, peak, failcnt = run_in_group(limit, argv)
    records = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    tok_s = records[0]["avg_ts"] if done.returncode == 0 and records else 0.0
    return {"tok_s": tok_s, "exit": done.returncode, "peak": peak, "failcnt": failcnt,
            "error": "" if done.returncode == 0 else done.stderr[-400:]}


def edgemoe_run(args, store: Path, limit: int, mode: str) -> dict:
    """One mode's decode tokens/s of `edgemoe bench` inside the limit, in a process of its own as a
    user's `edgemoe run` is (the bench confines itself after measuring the disk outside the limit),
    with the RAM tier it chose, its hit rate, disk MiB a token and the group's peak."""
    cmd = [sys.executable, "-m", "edgemoe", "bench", str(store), "--memory-limit", str(limit), "--ram", args.ram,
           "--mode", mode, "--prefill", str(args.prefill), "--decode-tokens", str(args.decode_tokens),
           "--warmup-tokens", str(args.warmup_tokens), "--repeats", "1", "--cold", "--threads", str(args.threads),
           "--json", "--quiet"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        return {"tok_s": 0.0, "exit": done.returncode, "error": done.stderr[-400:]}
    (record,) = json.loads(done.stdout)
    return {"tok_s": record["decode_tok_s"], "exit": 0, "ram_bytes": record["ram_bytes"],
            "hit_rate": record["hit_rate"], "disk_mib_per_token": record["disk_bytes_per_token"] / 2**20,
            "limit_tok_s": record["limit_decode_tok_s"],
            "peak": (done.stderr.strip().splitlines() or [""])[-1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--llama-bench", required=True)
    parser.add_argument("--pair", action="append", required=True, help="STORE=GGUF")
    parser.add_argument("--limit", nargs="+", required=True, help="cgroup memory limits, e.g. 640MiB 1GiB")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--ram", default="auto", help="edgemoe's --ram (default auto: sized inside the limit)")
    parser.add_argument("--mode", nargs="+", default=["on-demand-lru", "predictive"])
    parser.add_argument("--prefill", type=int, default=32)
    parser.add_argument("--decode-tokens", type=int, default=16)
    parser.add_argument("--warmup-tokens", type=int, default=4)
    parser.add_argument("--llama-gen", type=int, default=16)
    parser.add_argument("--llama-flags", default="--repack 0")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    print(f"CPU: {cpu_summary()}; load average {os.getloadavg()[0]:.2f}", flush=True)
    results = []
    for pair in args.pair:
        store, gguf = (Path(p) for p in pair.split("=", 1))
        for limit_text in args.limit:
            limit = parse_bytes(limit_text, "--limit")
            rounds = []
            for r in range(args.rounds):
                llama = llama_run(args, gguf, limit)
                edge = {mode: edgemoe_run(args, store, limit, mode) for mode in args.mode}
                rounds.append({"llama": llama, "edgemoe": edge})
                print(f"{store.name} {limit_text} round {r + 1}: llama.cpp {llama['tok_s']:.2f} tok/s "
                      f"(exit {llama['exit']}, peak {llama['peak'] / 2**20:.0f} MiB, limit hit {llama['failcnt']}x)",
                      flush=True)
                for mode, e in edge.items():
                    print(f"    edgemoe {mode}: {e['tok_s']:.2f} tok/s (exit {e['exit']}, RAM tier "
                          f"{e.get('ram_bytes', 0) / 2**20:.0f} MiB, hit rate {e.get('hit_rate', 0):.2f}, "
                          f"{e.get('disk_mib_per_token', 0):.1f} MiB/token read, bound by the disk at "
                          f"{e.get('limit_tok_s', 0):.2f} tok/s; {e.get('peak', e.get('error'))})",
                          flush=True)
            results.append({"store": str(store), "gguf": str(gguf), "limit": limit_text, "rounds": rounds})
            _print_summary(results[-1], args.mode)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


def _print_summary(result: dict, modes: list[str]) -> None:
    """Medians over the rounds that finished, and how many did not (killed or failed)."""
    def median_of(runs: list[dict]) -> tuple[float, int]:
        done = [r["tok_s"] for r in runs if r["exit"] == 0]
        return (statistics.median(done) if done else 0.0), len(runs) - len(done)

    llama, llama_lost = median_of([r["llama"] for r in result["rounds"]])
    line = f"== {Path(result['store']).name} in {result['limit']}: llama.cpp median {llama:.2f} tok/s"
    line += f" ({llama_lost} killed or failed)" if llama_lost else ""
    for mode in modes:
        runs = [r["edgemoe"][mode] for r in result["rounds"]]
        tok_s, lost = median_of(runs)
        ram = sorted({round(r["ram_bytes"] / 2**20) for r in runs if r["exit"] == 0})
        ratio = f"{tok_s / llama:.1f}x" if llama > 0 and tok_s > 0 else "n/a"
        line += (f"; edgemoe {mode} {tok_s:.2f} ({ratio}, RAM tier {'/'.join(map(str, ram)) or '-'} MiB"
                 + (f", {lost} of {len(runs)} killed or failed)" if lost else ")"))
    print(line, flush=True)


if __name__ == "__main__":
    main()
