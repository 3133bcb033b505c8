"""The `edgemoe` command: thin typer commands over the library. Errors in input print one line naming
the file, tensor or option, and exit with status 2."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import List, Optional

import typer

from .errors import EdgeMoEError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Run Mixture-of-Experts LLMs on machines too small to hold them.")


@app.callback()
def _group() -> None:
    """Run Mixture-of-Experts LLMs on machines too small to hold them."""


DTYPES = {"auto": None, "float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def _dtype_option():
    return typer.Option("auto", "--dtype", help="Dense weight matrices: auto (as the checkpoint stores "
                        "them), float32, bfloat16 or float16. Activations are float32 in every case.")


def _dtype(name: str):
    import torch
    if name not in DTYPES:
        raise typer.BadParameter(f"{name!r}: expected one of {', '.join(DTYPES)}", param_hint="--dtype")
    return None if DTYPES[name] is None else getattr(torch, DTYPES[name])


def _model_path(model: Optional[Path]) -> Path:
    if model is not None:
        return model
    from .bundled import bundled_model_path
    return bundled_model_path()


@app.command()
def run(
    model: Optional[Path] = typer.Argument(None, help="Checkpoint directory (default: the bundled model)."),
    prompt: str = typer.Option("", "--prompt", "-p", help="Text to continue (default: start from nothing)."),
    max_new_tokens: int = typer.Option(200, "--max-new-tokens", "-n"),
    temperature: Optional[float] = typer.Option(None, help="0 = greedy (default: the model's generation_config)."),
    top_k: Optional[int] = typer.Option(None, "--top-k"),
    top_p: Optional[float] = typer.Option(None, "--top-p"),
    seed: Optional[int] = typer.Option(None, help="Seed for sampling."),
    stop: List[str] = typer.Option([], "--stop", help="Stop when this text is produced (repeatable)."),
    chat: bool = typer.Option(False, "--chat", help="Wrap the prompt in the tokenizer's chat template."),
    ram: Optional[str] = typer.Option(None, "--ram", help="Store only: RAM budget for experts, e.g. 512MiB "
                                      "(default: unlimited)."),
    vram: Optional[str] = typer.Option(None, "--vram", help="Store only: VRAM budget for experts."),
    device: Optional[str] = typer.Option(None, "--device", help="Store only: torch device of the VRAM tier "
                                         "(default: cuda when present)."),
    policy: str = typer.Option("lru", "--policy", help="Store only: eviction policy, lru, lfu, edgemoe or expected-use."),
    preload: str = typer.Option("auto", "--preload", help="Store only: auto (correlation if the store has a "
                                "profile, else lookahead), correlation, lookahead or none."),
    stats: bool = typer.Option(False, "--stats", help="Print speed and cache figures after the text."),
    replay: Optional[Path] = typer.Option(None, "--replay", help="Route by this trace instead of the routers "
                                          "(a random-weight model routed as a real one was)."),
    dtype: str = _dtype_option(),
):
    """Generate text, streamed as it is produced, from a checkpoint directory or a store."""
    import edgemoe
    from .loader import is_store

    path = _model_path(model)
    store_options = dict(ram=ram, vram=vram, device=device, policy=policy, preload=preload) if is_store(path) else {}
    if not store_options and (ram or vram or device):
        raise EdgeMoEError(f"{path}: --ram/--vram/--device apply to stores; this is a checkpoint directory")
    m = edgemoe.load(path, _dtype(dtype), **store_options)
    if replay is not None:
        from edgemoe.store.profile import read_trace
        from .replay import RoutingReplay
        RoutingReplay(read_trace(replay), m.spec.moe_layer_ids, m.spec.num_experts, m.spec.top_k,
                      str(replay)).attach(m)
    if m.tokenizer is None:
        raise EdgeMoEError(f"{model}: no tokenizer.json, cannot generate text")
    text = m.tokenizer.apply_chat_template([{"role": "user", "content": prompt}]) if chat else prompt
    options = {k: v for k, v in dict(temperature=temperature, top_k=top_k, top_p=top_p).items() if v is not None}
    if not chat:
        sys.stdout.write(prompt)
    m.generate(text, on_text=lambda piece: (sys.stdout.write(piece), sys.stdout.flush()),
               max_new_tokens=max_new_tokens, seed=seed, stop_strings=tuple(stop), **options)
    sys.stdout.write("\n")
    if stats:
        _print_run_stats(m)


def _print_run_stats(model) -> None:
    from .stats import format_stats, run_stats

    for line in format_stats(run_stats(model)):
        print(f"[stats] {line}", file=sys.stderr)


@app.command()
def convert(
    model: Path = typer.Argument(..., help="Hugging Face checkpoint directory."),
    out: Path = typer.Option(..., "--out", "-o", help="Store directory to create."),
    bits: int = typer.Option(4, "--bits", help="Width of every expert: 2, 4 or 8."),
    widths: Optional[Path] = typer.Option(None, "--widths", help='Per-expert widths, JSON {"widths": '
                                          '{"<layer>": [bits, ...]}}, overriding --bits.'),
    group_size: Optional[int] = typer.Option(None, "--group-size", help="Quantization group along the input "
                                             "dimension (default: one group per row)."),
    method: str = typer.Option("rtn", "--method", help="rtn (round to nearest) or hqq (refined zero points)."),
    compress: Optional[str] = typer.Option(None, "--compress", help="zstd: compress each expert blob."),
    force: bool = typer.Option(False, "--force", help="Replace an existing store."),
    workers: Optional[int] = typer.Option(None, "--workers", help="Quantization threads (default: all cores)."),
    calib: Optional[Path] = typer.Option(None, "--calib", help="Calibration text: profile the store's routing "
                                         "on it, and search widths on it with --budget (default for the "
                                         "bundled model: its calib.txt)."),
    budget: Optional[str] = typer.Option(None, "--budget", help="Quality loss allowed, e.g. 5%: per-expert "
                                         "widths from 2/4/8, the store as small as possible within it."),
    metric: str = typer.Option("ppl", "--metric", help="Loss for --budget: ppl (relative perplexity increase), "
                               "top1 (1 - top-1 agreement) or kl (mean KL, nats/token)."),
    heldout: Optional[Path] = typer.Option(None, "--heldout", help="Held-out text to confirm the budget on "
                                           "(default for the bundled model: its eval.txt)."),
    calib_tokens: Optional[int] = typer.Option(None, "--calib-tokens", help="Use at most this many "
                                               "calibration tokens for --budget."),
    confidence: float = typer.Option(0.95, "--confidence", help="--budget must hold for this one-sided "
                                     "upper confidence bound of the calibration loss (0.5: the estimate)."),
):
    """Quantize a checkpoint's experts into a tiered store (and profile its routing on --calib)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from edgemoe.checkpoint import Checkpoint
    from edgemoe.store import convert as convert_store, read_widths
    from .loader import read_spec

    calib = calib or _bundled_text(model, "calib.txt")
    if budget is not None:
        if widths is not None:
            raise typer.BadParameter("--budget chooses the widths: give it or --widths, not both", param_hint="--budget")
        if calib is None:
            raise typer.BadParameter("--budget needs calibration text: --calib FILE (the bundled model uses its "
                                     "calib.txt)", param_hint="--calib")
        _convert_with_budget(model, out, budget, metric, calib, heldout or _bundled_text(model, "eval.txt"),
                             calib_tokens, group_size, method, force, confidence)
        return
    width_map = read_widths(widths, read_spec(Checkpoint(model))) if widths else None
    with Progress(TextColumn("quantizing experts"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  transient=True) as progress:
        task = progress.add_task("experts", total=None)
        report = convert_store(model, out, bits=bits, widths=width_map, group_size=group_size, method=method,
                               compress=compress, force=force, workers=workers,
                               on_progress=lambda done, total: progress.update(task, completed=done, total=total))
    if calib is not None:
        from .profiling import profile_store
        profile_store(out, text=_read_text(calib))
        print(f"profiled routing on {calib}")
    widths_text = ", ".join(f"INT{b}: {n}" for b, n in report.widths.items())
    print(f"wrote {report.store}: {report.experts} experts ({widths_text}), expert bytes {_size(report.expert_bytes)}"
          f" ({report.bits_per_weight:.3f} bits/weight), dense {_size(report.dense_bytes)}, "
          f"{report.seconds:.1f} s, peak RSS {_size(report.peak_rss_bytes)}")


@app.command()
def inspect(
    store: Path = typer.Argument(..., help="Store directory."),
    ram: Optional[str] = typer.Option(None, "--ram", help="Show where experts would be placed with this RAM budget."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Draw the width map (layer x expert) to this PNG "
                                        "(needs matplotlib: pip install 'edgemoe[plot]')."),
    as_json: bool = typer.Option(False, "--json"),
):
    """Summarise a store: model, sizes per layer and width, bits per weight, the width map, placement."""
    import json

    from edgemoe.store import inspect_store

    summary = inspect_store(store, ram=ram)
    if plot is not None:
        from .plots import plot_width_map
        plot_width_map(summary, plot)
    if as_json:
        print(json.dumps(summary, indent=1))
        return
    from rich.console import Console
    from rich.table import Table

    console = Console()
    m = summary["model"]
    console.print(f"{store}: {m['model_type']}, {m['layers']} layers, {m['experts']} experts/layer, top-{m['top_k']}, "
                  f"hidden {m['hidden']}, expert hidden {m['expert_hidden']}; format v{summary['version']}, "
                  f"{summary['quantization']}")
    console.print(f"experts {_size(summary['expert_bytes'])} at {summary['bits_per_weight']:.3f} bits/weight, "
                  f"dense {_size(summary['dense_bytes'])}")
    table = Table("layer", *[f"INT{b}" for b in (2, 4, 8)], "bytes", *(["in RAM"] if ram else []))
    for row in summary["layers"]:
        table.add_row(str(row["layer"]), *[str(row["widths"].get(str(b), 0)) for b in (2, 4, 8)],
                      _size(row["bytes"]), *([str(row["resident"])] if ram else []))
    console.print(table)
    width_map = Table("layer", *[f"e{e}" for e in range(m["experts"])], title="bits per expert")
    for layer, bits in summary["widths"].items():
        width_map.add_row(layer, *[str(b) for b in bits])
    console.print(width_map)
    if plot is not None:
        console.print(f"width map drawn to {plot}")


def _convert_with_budget(model, out, budget, metric, calib, heldout, calib_tokens, group_size, method, force,
                         confidence):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from .budget import convert_with_budget, parse_budget
    from .profiling import profile_store

    limit = parse_budget(budget)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  transient=True) as progress:
        tasks: dict = {}

        def show(stage, done, total):
            if stage not in tasks:
                tasks[stage] = progress.add_task(stage, total=total)
            progress.update(tasks[stage], completed=done, total=total)

        done = convert_with_budget(model, out, limit, metric, _read_text(calib),
                                   _read_text(heldout) if heldout else None, calib_tokens=calib_tokens,
                                   group_size=group_size, method=method, force=force, confidence=confidence,
                                   progress=show)
        profile_store(out, text=_read_text(calib))
    r, s = done.report, done.search
    widths_text = ", ".join(f"INT{b}: {n}" for b, n in r.widths.items())
    uniform = ", ".join(f"INT{b} {v:+.4f}" for b, v in s.uniform_loss.items())
    print(f"wrote {r.store}: {r.experts} experts ({widths_text}), expert bytes {_size(r.expert_bytes)} "
          f"({r.bits_per_weight:.3f} bits/weight), {r.seconds + sum(v for k, v in s.seconds.items() if k != 'total'):.1f} s")
    print(f"budget {metric} <= {limit:.4f}: calibration loss {s.loss:.4f} (bound {s.loss_bound:.4f})"
          + (f", held-out loss {done.heldout_loss:.4f}" if done.heldout_loss is not None else "")
          + f" (uniform: {uniform}; floor INT{s.floor}, ceiling INT{s.ceiling}, {s.moved_down} experts at the floor)")
    if not s.feasible:
        print("warning: even INT8 everywhere exceeds the budget on the calibration text; wrote all INT8")


def _bundled_text(model: Path, name: str) -> Optional[Path]:
    """The bundled model's calib.txt / eval.txt when `model` is the bundled checkpoint."""
    from .bundled import BUNDLED_DIR

    return BUNDLED_DIR / name if model.resolve() == BUNDLED_DIR and (BUNDLED_DIR / name).exists() else None


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


@app.command()
def trace(
    model: Path = typer.Argument(..., help="Store or checkpoint directory."),
    text: Path = typer.Option(..., "--text", help="UTF-8 text to run through the model."),
    out: Path = typer.Option(..., "--out", "-o", help="Trace file to write (JSON lines, docs/trace-format.md)."),
    context: Optional[int] = typer.Option(None, help="Window length in tokens (default: as edgemoe eval)."),
):
    """Record the routers' choices over a text as a trace."""
    import edgemoe
    from edgemoe.store.profile import write_trace
    from .loader import is_store
    from .profiling import trace_text

    m = edgemoe.load(model, **({"preload": "none"} if is_store(model) else {}))
    records = trace_text(m, _read_text(text), context)
    write_trace(out, records)
    print(f"wrote {out}: {len(records)} records ({len({(r.seq, r.token) for r in records})} tokens)")


@app.command()
def profile(
    store: Path = typer.Argument(..., help="Store directory."),
    text: Optional[Path] = typer.Option(None, "--text", help="Calibration text to run through the store."),
    trace_file: Optional[Path] = typer.Option(None, "--trace", help="Or: build the profile from this trace."),
    context: Optional[int] = typer.Option(None, help="Window length in tokens."),
    min_count: int = typer.Option(3, "--min-count", help="Back off from a correlation key seen fewer times."),
):
    """Store the routing profile (popularity, correlation table) used for placement and preload."""
    from .profiling import profile_store

    if (text is None) == (trace_file is None):
        raise typer.BadParameter("give --text or --trace (exactly one)")
    result = profile_store(store, _read_text(text) if text else None, trace_file, context, min_count)
    print(f"profiled {store}: {sum(result.counts[result.moe_layers[0]]) // result.top_k} tokens, "
          f"{sum(len(t) for t in result.given_prev2.values())} correlation keys; saved to {store}/profile.json")


@app.command()
def bench(
    store: Path = typer.Argument(..., help="Store directory."),
    ram: str = typer.Option("25%", "--ram", help="RAM budget for experts: bytes (e.g. 1GiB) or a share of the "
                            "store's expert bytes (e.g. 25%)."),
    mode: List[str] = typer.Option([], "--mode", help="all-in-ram, on-demand-lru or edgemoe (repeatable; "
                                   "default: all three)."),
    prefill: List[int] = typer.Option([], "--prefill", help="Prompt length in tokens (repeatable; default 512 "
                                      "and 2048)."),
    decode_tokens: int = typer.Option(32, "--decode-tokens", help="Timed decode steps per run."),
    warmup_tokens: int = typer.Option(4, "--warmup-tokens", help="Decode steps before the timed ones."),
    repeats: int = typer.Option(3, "--repeats", help="Runs per mode and prompt length (medians reported)."),
    cold: bool = typer.Option(False, "--cold", help="Drop the store's files from the page cache before each run."),
    replay: Optional[Path] = typer.Option(None, "--replay", help="Route by this trace (a random-weight model "
                                          "routed as a real one was)."),
    memory_limit: Optional[str] = typer.Option(None, "--memory-limit", help="Run inside a cgroup v1 memory "
                                               "limit of this size, page cache included (Linux, root)."),
    as_json: bool = typer.Option(False, "--json", help="Print the records as JSON."),
    dtype: str = _dtype_option(),
):
    """Time to first token and decode speed under a RAM budget, per mode, next to the physical limit."""
    import json

    from .bench import (MODES, BenchConfig, bench as run_bench, confine_memory, leave_memory_group,
                        machine_summary, measure_bandwidths, parse_ram)

    config = BenchConfig(ram=parse_ram(ram, store), modes=tuple(mode) or MODES,
                         prefill_tokens=tuple(prefill) or (512, 2048), decode_tokens=decode_tokens,
                         warmup_tokens=warmup_tokens, repeats=repeats, cold=cold,
                         replay=_replay_for(store, replay), dtype=_dtype(dtype))
    # The bandwidths are measured first, outside the memory limit: their 1 GiB buffer is not the run's.
    bandwidths = measure_bandwidths(store)
    group = confine_memory(memory_limit) if memory_limit is not None else None
    progress = None if as_json else lambda r: print(
        f"  {r['mode']:<14} prefill {r['prefill_tokens']}: ttft {r['ttft_s']:.2f} s, "
        f"decode {r['decode_tok_s']:.2f} tok/s, hit rate {r['hit_rate']:.3f}", file=sys.stderr, flush=True)
    try:
        records, _ = run_bench(store, config, on_run=progress, bandwidths=bandwidths)
    finally:
        usage = leave_memory_group(group) if group is not None else None
    peak_line = None if usage is None else (f"peak memory of the run, page cache included: {_size(usage[0])}; "
                                            f"limit hit {usage[1]} times (memory.failcnt)")
    if as_json:
        print(json.dumps(records, indent=1))
        if peak_line:
            print(peak_line, file=sys.stderr)
        return
    print(machine_summary(bandwidths, memory_limit))
    if peak_line:
        print(peak_line)
    _print_bench_table(records)


def _replay_for(store: Path, trace: Optional[Path]):
    """The trace's routing laid over the store's model (refused here, naming the file, if it does not fit)."""
    if trace is None:
        return None
    from edgemoe.store import read_manifest
    from edgemoe.store.profile import read_trace
    from .replay import RoutingReplay

    spec = read_manifest(store).spec
    return RoutingReplay(read_trace(trace), spec.moe_layer_ids, spec.num_experts, spec.top_k, str(trace))


def _print_bench_table(records: list) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table("mode", "RAM", "prompt", "TTFT s", "decode tok/s", "limit tok/s", "of limit", "hit rate",
                  "disk MiB/token")
    for r in records:
        table.add_row(r["mode"], _size(r["ram_bytes"]), str(r["prefill_tokens"]), f"{r['ttft_s']:.2f}",
                      f"{r['decode_tok_s']:.2f}", f"{r['limit_decode_tok_s']:.2f}",
                      f"{r['decode_tok_s'] / r['limit_decode_tok_s']:.0%}", f"{r['hit_rate']:.3f}",
                      f"{r['disk_bytes_per_token'] / 2**20:.1f}")
    Console(width=max(120, Console().width)).print(table)


@app.command("eval")
def eval_(
    model: Optional[Path] = typer.Argument(None, help="Checkpoint directory (default: the bundled model)."),
    text: Optional[Path] = typer.Option(None, "--text", help="UTF-8 text file (default with the bundled "
                                        "model: its held-out eval.txt)."),
    reference: Optional[Path] = typer.Option(None, "--reference", help="Also report top-1 agreement and KL "
                                             "divergence against this model."),
    context: Optional[int] = typer.Option(None, help="Window length in tokens (default: the model's "
                                          "max_position_embeddings, at most 1024)."),
    stride: Optional[int] = typer.Option(None, help="Window step (default: context / 2)."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
    dtype: str = _dtype_option(),
    compute: Optional[str] = typer.Option(None, help="A store's expert compute path: auto (default), "
                                          "fused-int, fused-float, dequant or device."),
):
    """Perplexity over a text (sliding window); with --reference, agreement and KL too."""
    import json

    import edgemoe
    from .evaluate import evaluate_text

    if text is None:
        if model is not None:
            raise typer.BadParameter("--text is required for a model other than the bundled one", param_hint="--text")
        from .bundled import bundled_text
        text = bundled_text("eval.txt")
    content = _read_text(text)
    from .loader import is_store

    path = _model_path(model)
    if compute is not None and not is_store(path):
        raise EdgeMoEError(f"{path}: --compute applies to stores; this is a checkpoint directory")
    m = edgemoe.load(path, _dtype(dtype), **({"compute": compute} if compute is not None else {}))
    ref = edgemoe.load(reference, _dtype(dtype)) if reference is not None else None
    result = evaluate_text(m, content, context=context, stride=stride, reference=ref)
    if as_json:
        print(json.dumps(result.to_dict()))
        return
    print(f"text: {text} ({result.tokens} tokens scored; context {result.context} tokens, stride {result.stride})")
    print(f"perplexity: {result.perplexity:.4f}   (nll {result.nll:.4f} nats/token)")
    if ref is not None:
        print(f"reference perplexity: {result.reference_perplexity:.4f}")
        print(f"top-1 agreement with reference: {result.top1_agreement:.4f}")
        print(f"mean KL(reference || model): {result.kl:.6f} nats/token")


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise EdgeMoEError(f"{path}: text file not found") from None
    except UnicodeDecodeError as e:
        raise EdgeMoEError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def main() -> None:
    try:
        app()
    except EdgeMoEError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except (ValueError, OSError) as e:  # bad options reaching the library, unreadable files
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
