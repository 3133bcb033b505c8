"""`edgemoe convert`: a Hugging Face checkpoint -> a store, as one pipeline.

    1. check the destination and the inputs (before any work);
    2. open the checkpoint once: its spec and weight plan from the headers;
    3. with a quality budget: load the checkpoint's dense weights (and, for an encoder-decoder
       model, its experts; a decoder-only model's are read a layer at a time), search per-expert
       widths on the calibration text (edgemoe.convert.budget), its work files (the packed experts
       at every width among them) inside the partial store;
    4. write the copied files, the dense tensors, and every expert (copied from the search's packed
       experts at its width, or each quantized as it streams through a thread pool); remove the
       search's work files;
    5. open the store being written (its manifest still in memory, a RAM tier of two layers'
       experts) to profile its routing on the calibration text and, after a search, to confirm the
       loss on held-out text;
    6. write the manifest once, with the search's record, and move the store into place.

Errors (StoreError, CheckpointError, OptionError, naming the file or option) come before step 3
where they can; whatever fails later leaves nothing at the destination (edgemoe.convert.writer).
"""

from __future__ import annotations

import os
import resource
import time
from collections import Counter
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from edgemoe.checkpoint import Checkpoint
from edgemoe.errors import CheckpointError
from edgemoe.evaluate import evaluate
from edgemoe.loader import CheckpointExperts, StoreOptions, load_store, model_from_checkpoint, plan_checkpoint
from edgemoe.options import OptionError, integer_at_least, one_of
from edgemoe.tracing import profile_text
from edgemoe.quant import quantize
from edgemoe.store.profile_file import save_routing_profile
from edgemoe.weights import read_expert

from .budget import (BudgetResult, BudgetSearch, Calibration, IMPORTANCE_METHODS, METRICS, WindowSample, heldout_loss,
                     metric_loss, sample_for_time)
from .writer import Key, StoreWriter, check_destination, read_widths

Progress = Callable[[str, int, int], None]    # (stage, done, total)
# Tokens of the calibration text traced for the routing profile by default: chosen by measurement
# (docs/budget.md, "The routing profile's tokens").
PROFILE_TOKENS = 4096
# The quality search's time target by default, in minutes (QualityBudget.search_minutes): with the
# store's writing and profiling, a convert of the bench checkpoints within 15 minutes on 2 cores.
SEARCH_MINUTES = 10.0


@dataclass(frozen=True)
class QualityBudget:
    """--budget: the largest quality loss allowed, by `metric` (edgemoe.convert.budget), judged on
    the calibration text's upper confidence bound and confirmed on `heldout_text` when given;
    `importance`: how experts are ranked, "local" or "exact" (edgemoe.convert.budget).
    calib_tokens: the calibration text's first tokens only; search_minutes: then as many windows,
    evenly spread, as the search's projected time fits (budget.sample_for_time; None: all)."""

    limit: float
    metric: str = "ppl"
    confidence: float = 0.95
    calib_tokens: int | None = None
    heldout_text: str | None = None
    context: int = 256
    importance: str = "local"
    search_minutes: float | None = SEARCH_MINUTES

    def __post_init__(self):
        one_of(self.metric, "metric=", METRICS)
        one_of(self.importance, "importance=", IMPORTANCE_METHODS)
        if not 0.5 <= self.confidence < 1:
            raise OptionError("confidence=", self.confidence, "expected a number in [0.5, 1)")
        if not self.limit >= 0:
            raise OptionError("budget=", self.limit, "expected a loss >= 0")
        if self.search_minutes is not None and not self.search_minutes > 0:
            raise OptionError("search_minutes=", self.search_minutes, "expected a time above 0 (None: no target)")


@dataclass
class ConvertReport:
    store: Path
    experts: int
    expert_bytes: int
    dense_bytes: int
    expert_params: int
    seconds: float
    peak_rss_bytes: int
    widths: dict[int, int] = field(default_factory=dict)   # bits -> number of experts
    search: BudgetResult | None = None
    sample: WindowSample | None = None     # the calibration windows a time target let the search use
    heldout_loss: float | None = None
    profiled: bool = False
    fallback_copies: int = 0          # experts with a narrower copy (--fallback-bits)
    fallback_bytes: int = 0

    @property
    def bits_per_weight(self) -> float:
        """Stored expert bits (codes, scales and zeros) per expert weight."""
        return 8 * self.expert_bytes / self.expert_params


def convert(model_dir, out, bits: int = 4, widths: dict[Key, int] | str | Path | None = None, group_size: int | None = None,
            method: str = "rtn", compress: str | None = None, force: bool = False, workers: int | None = None,
            budget: QualityBudget | None = None, calib_text: str | None = None, threads: int | None = None,
            progress: Progress | None = None, inputs=(), fallback_bits: int | None = None,
            allow_no_tokenizer: bool = False, profile_tokens: int | None = PROFILE_TOKENS,
            notice: Callable[[str], None] | None = None) -> ConvertReport:
    """Convert the checkpoint at `model_dir` into a store at `out`. widths: per-expert bits overriding
    `bits` ({(layer, expert): bits}, or a width file: read_widths); budget: search them instead (needs calib_text); calib_text: also profile the store's
    routing on it. inputs: other files the command reads (never overwritten, see check_destination).
    fallback_bits: also store each wider expert narrowed to this width (edgemoe.quant.narrow), the
    copy a runtime reads for a weakly chosen miss (StoreOptions.fallback_below).
    allow_no_tokenizer: convert a checkpoint without tokenizer.json (see check_tokenizer).
    profile_tokens: trace at most this many tokens of calib_text for the routing profile (None: all).
    notice(message): told the search's projected time, and how it sampled the calibration windows
    where that exceeded its time target (sample_message)."""
    start = time.perf_counter()
    one_of(bits, "bits=", (2, 4, 8))
    one_of(compress, "compress=", (None, "zstd"))
    one_of(fallback_bits, "fallback_bits=", (None, 2, 4))
    integer_at_least(profile_tokens, "profile_tokens=", 1)
    if budget is not None and (widths is not None or calib_text is None):
        raise OptionError("budget=", budget.limit, "needs calibration text (calib_text) and no fixed widths")
    out = Path(out)
    check_destination(out, force, [Path(model_dir), *map(Path, inputs)])
    check_tokenizer(Path(model_dir), allow_no_tokenizer, calib_text is not None)
    report = progress or (lambda stage, done, total: None)
    ckpt = Checkpoint(model_dir)
    try:
        spec, plan = planned = plan_checkpoint(ckpt)
        keys = sorted(plan.experts)
        if isinstance(widths, (str, Path)):
            widths = read_widths(widths, spec)
        with StoreWriter(out) as writer:
            searcher, sample = (_searcher(ckpt, planned, budget, calib_text, group_size, method, threads, report,
                                          writer.partial, notice) if budget is not None else (None, None))
            with searcher or nullcontext():
                search = searcher.run(budget.limit) if searcher else None
                widths = {key: ((search.widths if search else widths) or {}).get(key, bits) for key in keys}
                if fallback_bits and max(widths.values()) <= fallback_bits:
                    raise OptionError("fallback_bits=", fallback_bits, f"no expert is wider (the widest is "
                                      f"{max(widths.values())} bits): there is nothing to narrow")

                def quantized(key: Key) -> dict:
                    if searcher:     # packed by the search at every width: copied, not quantized again
                        return searcher.experts.packed.get(key, widths[key])
                    weights = read_expert(ckpt, plan.experts[key])
                    return {role: quantize(w, widths[key], group_size, method) for role, w in weights.items()}

                writer.copy_files(ckpt.path)
                writer.write_dense(ckpt, plan.dense)
                writer.write_experts(keys, quantized, compress, workers or os.cpu_count() or 1,
                                     lambda done, total: report("writing experts", done, total), fallback_bits)
            extra = {"budget": {**search.to_json(), "sample": sample and sample.to_json()}} if search is not None else {}
            manifest = writer.manifest(spec, ckpt.path, method, group_size, extra)
            heldout = _profile_and_confirm(writer.partial, manifest, calib_text, profile_tokens, budget,
                                           searcher.model if searcher else None,
                                           threads, report)
            if heldout is not None:
                manifest.data["budget"]["heldout_loss"] = heldout
            writer.commit(manifest)
    finally:
        ckpt.close()
    return _report(out, writer, widths, start, search, sample, heldout, calib_text is not None)


def check_tokenizer(model_dir: Path, allow_missing: bool, reads_text: bool) -> None:
    """Refuse, before any work, a checkpoint without tokenizer.json unless `allow_missing`: its store
    would run token ids only (edgemoe bench, the Python API), and every command given text (run,
    eval, chat, serve, trace, profile --text) would refuse it. Calibration text needs it always."""
    path = model_dir / "tokenizer.json"
    if path.exists():
        return
    if reads_text:
        raise CheckpointError(f"{path}: not found, and the calibration text (--calib, --budget) is read with it")
    if not allow_missing:
        raise CheckpointError(f"{path}: not found, so the store could not run text (edgemoe run, eval and chat "
                              f"would refuse it); copy the checkpoint's tokenizer.json there, or convert anyway "
                              f"for token ids only (--allow-no-tokenizer, allow_no_tokenizer=True)")


def _searcher(ckpt: Checkpoint, planned, budget: QualityBudget, calib_text: str, group_size, method, threads,
              report: Progress, workdir: Path, notice) -> tuple[BudgetSearch, WindowSample | None]:
    """The search on the calibration text, its experts read and packed (its work files in
    `workdir`), and the windows its time target let it use (None: no target). A decoder-only model's
    experts are read lazily and its reference computed by the search, layer by layer; an
    encoder-decoder model is loaded whole and its reference computed here."""
    reference = model_from_checkpoint(ckpt, planned, threads=threads, lazy_experts=not planned[0].is_encoder_decoder)
    ids = torch.tensor(reference.tokenizer.encode(calib_text, add_special_tokens=False))
    if budget.calib_tokens is not None:
        ids = ids[:budget.calib_tokens]
    context = min(budget.context, reference.context_length)
    calibration = Calibration(reference.spec, ids, context, budget.metric, budget.confidence)
    sample = None
    if budget.search_minutes is not None:
        sample = sample_for_time(reference, calibration, budget.search_minutes, budget.importance)
        if notice:
            notice(sample_message(sample))
    if not isinstance(reference.experts, CheckpointExperts):
        calibration.compute_reference(reference)
    return BudgetSearch(reference, calibration, group_size, method, report, budget.importance, workdir), sample


def sample_message(sample: WindowSample) -> str:
    """The search's projected time and, where it sampled the windows, how many and why."""
    projected, target = sample.projected_seconds() / 60, sample.minutes
    if sample.windows == sample.of:
        return (f"the quality search is projected at {projected:.1f} min on all {sample.of} calibration windows "
                f"(its time target: {target:g} min)")
    fit = (f"to fit its time target of {target:g} min: projected {projected:.1f} min" if projected <= target else
           f"the fewest it uses, though projected at {projected:.1f} min, over its time target of {target:g} min")
    return (f"the quality search runs on {sample.windows} of {sample.of} calibration windows ({sample.tokens:,} of "
            f"{sample.of_tokens:,} tokens, evenly spread), {fit}; "
            f"{sample.projected_seconds(sample.of_tokens) / 60:.1f} min on all (--search-minutes 0: all)")


def _profile_and_confirm(path: Path, manifest, calib_text, profile_tokens, budget, reference, threads,
                         report: Progress) -> float | None:
    """Open the store being written: profile its routing on calib_text's first profile_tokens tokens
    (saved beside it) and, after a search, measure the held-out loss against the reference model
    (returned)."""
    if calib_text is None:
        return None
    with load_store(path, StoreOptions(preload="none", ram=_two_layers(manifest)), threads=threads,
                    manifest=manifest) as model:
        save_routing_profile(path, *profile_text(model, calib_text, max_tokens=profile_tokens,
                                                 on_progress=lambda d, t: report("profiling routing", d, t)))
        if budget is None or budget.heldout_text is None:
            return None
        ids = model.tokenizer.encode(budget.heldout_text, add_special_tokens=False)
        context = min(budget.context, model.context_length)   # windows as the calibration's
        if model.spec.is_encoder_decoder:     # text-to-text windows; `evaluate` is next-token only
            loss = heldout_loss(model, reference, torch.tensor(ids), context, budget.metric)
            report("confirming on held-out text", 1, 1)
            return loss
        result = evaluate(model, ids, context=context, stride=context, reference=reference,
                          on_progress=lambda d, t: report("confirming on held-out text", d, t))
        return metric_loss(result, budget.metric)


def _two_layers(manifest) -> int:
    """Bytes of the two largest MoE layers' experts: the RAM tier of the store the converter opens,
    so that its memory does not grow with the model (a pass reads a layer's experts once per window)."""
    per_layer = Counter()
    for (layer, _), entry in manifest.experts.items():
        per_layer[layer] += entry.length
    return sum(sorted(per_layer.values())[-2:])


def _report(out: Path, writer: StoreWriter, widths, start: float, search, sample, heldout, profiled) -> ConvertReport:
    counts = Counter(widths.values())
    entries = writer.entries
    params = sum(t["shape"][0] * t["shape"][1] for e in entries for t in e.tensors.values())
    return ConvertReport(out, len(entries), sum(e.stored_length for e in entries),
                         (out / "dense.safetensors").stat().st_size, params, time.perf_counter() - start,
                         resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, dict(sorted(counts.items())),
                         search, sample, heldout, profiled, len(writer.fallback_entries),
                         sum(e.stored_length for e in writer.fallback_entries))
