"""Figures of a generation run (`edgemoe run --stats`, `edgemoe bench`): speed, cache, I/O, preload."""

from __future__ import annotations


def run_stats(model, speculation=None) -> dict:
    """From the model's step timings and, for a store, its tier counters. The prefill is every step
    until the first new token was chosen (Timings.first_token_chosen; all of them when none was),
    each later step decodes one token. speculation: a speculative run's SpeculationStats
    (edgemoe.speculative); then decode counts output tokens and the draft's time too, and the
    speculation's figures are added."""
    t = model.timings
    steps = t.per_step
    stats: dict = {}
    if steps:
        first = len(steps) if t.prefill_steps is None else t.prefill_steps
        prefill, decode = steps[:first], steps[first:]
        prefill_tokens, ttft = sum(n for n, _ in prefill), sum(s for _, s in prefill)
        decode_tokens, decode_seconds = len(decode), sum(s for _, s in decode)
        if speculation is not None:
            decode_tokens = max(0, speculation.emitted - 1)
            decode_seconds = speculation.decode_seconds
        stats.update(prefill_tokens=prefill_tokens, ttft_s=ttft, prefill_tok_s=prefill_tokens / ttft,
                     decode_tokens=decode_tokens, decode_tok_s=decode_tokens / decode_seconds if decode_seconds else None)
    if speculation is not None:
        stats["speculation"] = speculation.to_dict()
    stats["time_split_s"] = {"attention": t.attention, "experts": t.experts, "layers": t.layers, "other": t.other}
    store = getattr(model.experts, "store", None)
    if store is not None:
        s = store.stats
        io_wait = getattr(model.experts, "io_wait_seconds", 0.0)
        stats["time_split_s"].update(experts_compute=t.experts - io_wait, io_wait=io_wait)
        stats.update(hit_rate=s.hit_rate, vram_hits=s.vram.hits, ram_hits=s.ram.hits, disk_loads=s.misses,
                     disk_bytes_read=s.disk_bytes_read,
                     disk_bytes_per_token=s.disk_bytes_read / t.tokens if t.tokens else 0.0,
                     preloads=s.preloads_loaded, preloads_used=s.preloads_used, preloads_wasted=s.preloads_wasted,
                     preload_precision=s.preloads_used / s.preloads_loaded if s.preloads_loaded else None)
        preloader = getattr(model, "preloader", None)
        if preloader is not None:
            stats.update(predictor=preloader.predictor, predictor_precision=preloader.precision,
                         predictor_recall=preloader.recall)
    return stats


def format_stats(stats: dict) -> list[str]:
    lines = []
    if "ttft_s" in stats:
        decode = f"{stats['decode_tok_s']:.2f} tok/s" if stats.get("decode_tok_s") else "n/a"
        lines.append(f"prefill {stats['prefill_tokens']} tokens: {stats['prefill_tok_s']:.1f} tok/s "
                     f"(time to first token {stats['ttft_s']:.3f} s); decode {stats['decode_tokens']} tokens: {decode}")
    split = ", ".join(f"{k} {v:.3f} s" for k, v in stats["time_split_s"].items())
    lines.append(f"time: {split}")
    if "hit_rate" in stats:
        lines.append(f"experts: hit rate {stats['hit_rate']:.3f} (vram {stats['vram_hits']}, ram {stats['ram_hits']}, "
                     f"disk {stats['disk_loads']}); disk read {stats['disk_bytes_read'] / 2**20:.1f} MiB "
                     f"({stats['disk_bytes_per_token'] / 2**20:.2f} MiB/token)")
        precision = stats.get("preload_precision")
        predictor = stats.get("predictor_precision")
        lines.append(f"preload ({stats.get('predictor', 'none')}): {stats['preloads']} loaded, {stats['preloads_used']} "
                     f"used, {stats['preloads_wasted']} wasted; precision "
                     f"{'n/a' if precision is None else f'{precision:.3f}'}, predictor precision "
                     f"{'n/a' if predictor is None else f'{predictor:.3f}'}")
    if "speculation" in stats:
        lines.append(_speculation_line(stats["speculation"]))
    return lines


def _speculation_line(s: dict) -> str:
    def share(value):
        return "n/a" if value is None else f"{value:.3f}"

    per_token = "n/a" if s["seconds_per_token"] is None else f"{s['seconds_per_token'] * 1000:.1f} ms"
    return (f"speculation: {s['rounds']} rounds, acceptance {share(s['acceptance_rate'])} ({s['accepted']} of "
            f"{s['drafted']} drafted), {per_token} per output token (draft {s['draft_seconds']:.3f} s, verify "
            f"{s['verify_seconds']:.3f} s); prefetched {s['prefetched']} experts, precision "
            f"{share(s['prefetch_precision'])}"
            + ("" if s["draft_copy_bytes"] is None else f"; INT2 draft copy {s['draft_copy_bytes'] / 2**20:.1f} MiB")
            + (f"; {s['plain_tokens']} tokens decoded plainly" if s["plain_tokens"] else ""))
