"""edgemoe against llama.cpp on the same checkpoint, all in RAM, interleaved rounds, same threads.

Per pair STORE=GGUF (an edgemoe store and the GGUF file of the same checkpoint at the matching
width, e.g. an INT4 store and Q4_0), each round runs llama-bench (prefill of 512 tokens; 32 decoded
tokens after a 512-token prompt, `-d 512`) and `edgemoe bench --mode all-in-ram --prefill 512` once
per --dense-bits setting, one after the other, so that a machine's drift hits both programs alike.

    python tools/bench_vs_llamacpp.py --llama-bench PATH/llama-bench --threads 2 --rounds 2 \\
        --pair STORE_INT4=MODEL-Q4_0.gguf --pair STORE_INT8=MODEL-Q8_0.gguf [--dense-bits auto none] [--json OUT]
        [--llama-flags "-fa 0"]   # more llama-bench flags for both of its tests (default: none, its defaults)

Prints one table row per pair and program setting: medians over rounds of each run's mean tokens/s
(llama-bench's avg_ts; edgemoe bench's median over its --repeats), and the ratio to llama.cpp. The
machine's CPU flags and load average are printed first.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys


def llama_bench(binary: str, gguf: str, threads: int, prompt: int, generate: int, depth: int,
                flags: list[str] = ()) -> float:
    """llama-bench's mean tokens/s for one test (3 repetitions), with more of its flags."""
    cmd = [binary, "-m", gguf, "-t", str(threads), "-p", str(prompt), "-n", str(generate), "-r", "3", "-o", "jsonl",
           *flags]
    if depth:
        cmd += ["-d", str(depth)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    (record,) = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return record["avg_ts"]


def edgemoe_bench(store: str, threads: int, dense_bits: str, prefill: int) -> tuple[float, float]:
    """(prefill tokens/s, decode tokens/s) of `edgemoe bench --mode all-in-ram`, medians of 3 runs."""
    cmd = [sys.executable, "-m", "edgemoe", "bench", store, "--mode", "all-in-ram", "--prefill", str(prefill),
           "--repeats", "3", "--threads", str(threads), "--json", "--quiet"]
    cmd += ["--dense-bits", dense_bits]
    records = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    (record,) = [r for r in records if r["prefill_tokens"] == prefill]
    return record["prefill_tokens"] / record["ttft_s"], record["decode_tok_s"]


def cpu_summary() -> str:
    """The CPU's model name and the instruction-set extensions the kernels choose paths by."""
    with open("/proc/cpuinfo") as f:
        info = f.read()
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    flags = set(next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), []))
    wanted = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_tile")
    return f"{model}, {os.cpu_count()} CPUs, flags {' '.join(f for f in wanted if f in flags)}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--llama-bench", required=True)
    parser.add_argument("--pair", action="append", required=True, help="STORE=GGUF")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--prefill", type=int, default=512)
    parser.add_argument("--dense-bits", nargs="+", default=["auto", "none"], choices=["auto", "none", "8", "4"],
                        help="edgemoe settings to run (auto: the default, dense.dense_bits_for)")
    parser.add_argument("--llama-flags", default="", help="more llama-bench flags, e.g. \"-fa 0\"")
    parser.add_argument("--json", help="write every run's figures here")
    args = parser.parse_args()
    pairs = [tuple(p.split("=", 1)) for p in args.pair]
    print(f"machine: {cpu_summary()}; load average {os.getloadavg()[0]:.2f}", flush=True)
    runs: dict[tuple, list] = {}
    for r in range(args.rounds):
        for store, gguf in pairs:
            name = os.path.basename(gguf)
            flags = shlex.split(args.llama_flags)
            prefill = llama_bench(args.llama_bench, gguf, args.threads, args.prefill, 0, 0, flags)
            decode = llama_bench(args.llama_bench, gguf, args.threads, 0, 32, args.prefill, flags)
            runs.setdefault((store, gguf, "llama.cpp"), []).append((prefill, decode))
            print(f"round {r + 1} {name} llama.cpp: prefill {prefill:.2f} decode {decode:.2f} t/s", flush=True)
            for bits in args.dense_bits:
                figures = edgemoe_bench(store, args.threads, bits, args.prefill)
                runs.setdefault((store, gguf, f"edgemoe dense {bits}"), []).append(figures)
                print(f"round {r + 1} {store} edgemoe --dense-bits {bits}: prefill {figures[0]:.2f} "
                      f"decode {figures[1]:.2f} t/s", flush=True)
    print(f"\n| store / GGUF | program | prefill {args.prefill} t/s | x llama.cpp | decode t/s (after {args.prefill}) "
          f"| x llama.cpp |\n|---|---|---:|---:|---:|---:|")
    for store, gguf in pairs:
        peer = [statistics.median(f[i] for f in runs[(store, gguf, "llama.cpp")]) for i in (0, 1)]
        for program in ["llama.cpp"] + [f"edgemoe dense {b}" for b in args.dense_bits]:
            med = [statistics.median(f[i] for f in runs[(store, gguf, program)]) for i in (0, 1)]
            print(f"| {os.path.basename(store)} / {os.path.basename(gguf)} | {program} | {med[0]:.2f} | "
                  f"{med[0] / peer[0]:.2f} | {med[1]:.2f} | {med[1] / peer[1]:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{"store": s, "gguf": g, "program": p, "runs": v} for (s, g, p), v in runs.items()], f, indent=1)


if __name__ == "__main__":
    main()
