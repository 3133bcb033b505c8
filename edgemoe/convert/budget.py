"""Per-expert bit widths under a measured quality budget (EdgeMoE's expert bit-width adaptation).

Quality loss of a width assignment, against the unquantized model on calibration text, by metric:
    ppl   relative perplexity increase, ppl_quantized / ppl_reference - 1   (default)
    top1  1 - top-1 next-token agreement with the reference
    kl    mean KL(reference || quantized), nats per token
Search (widths from {2, 4, 8}):
 0. "Within the budget" means the loss's upper confidence bound (default 95%, one-sided, from the
    spread over calibration windows) is at most the budget: the text is a sample.
 1. Uniform stores, narrowest first: the loss of all-2, then all-4, then all-8, stopping at the first
    within the budget: that width is the ceiling (8 if none is: the budget cannot be met, reported);
    the floor is the next lower width. If the ceiling is 2, every expert is at 2.
 2. Importance of each expert, on one half of the calibration windows, by one of two methods:
    local (default)  one pass of the all-ceiling model records, for each expert, its local error:
                     sum over the tokens routed to it of |w_t * (y_floor(x_t) - y_ceiling(x_t))|^2,
                     w_t its routing weight, x_t its input (so frequency counts too). Each layer's
                     sensitivity, measured once per layer, turns local error into loss: the loss
                     change with the whole layer at the floor, divided by the layer's summed local
                     error. Importance = sensitivity of its layer x local error. Cost: one pass plus
                     one re-run per layer, whatever the number of experts. sensitivity_groups=G:
                     one sensitivity per group of consecutive layers instead (G re-runs).
    exact            each expert alone at the floor, every other at the ceiling, the loss change.
                     Cost: one re-run per expert.
    Re-runs are cheap: each window's input to every layer is cached for the all-ceiling model, so
    the loss with some layer's experts changed is measured by re-running from that layer only
    (exact). An encoder-decoder model (Seq2SeqModel, windows read as text-to-text: Calibration) is
    re-run whole: its decoder layers read the encoder's output too, which that cache does not carry.
    No window is evaluated twice under the same widths: its loss is kept and reused.
 3. The least important experts go down first: a search, on the other half of the windows, for the
    largest K whose K least important experts at the floor keep the loss within the budget, each
    step at the K the summed importance predicts between the nearest measured counts (a binary
    search's answer in fewer passes where the importance predicts the loss: _largest_k).
    After a local ranking, the BOUNDARY experts on each side of the cut are re-ranked by their exact
    importance and K is searched again among them: a ranking error matters only near the cut.
    The mix must also hold on all the windows: fewer experts at the floor until its bound does.
    Ranking and choosing on the same text would favour experts whose measured importance was low by
    chance, and the mix would then exceed the budget on new text (measured: docs/budget.md).
The converter (edgemoe.convert) writes the packed experts the search made and confirms the loss end
to end, from the written store, on held-out text the search never saw.

Inputs: the checkpoint's model, loaded whole or with its experts read lazily (CheckpointExperts),
token ids of the calibration text. A decoder-only model's search streams (docs/budget.md, "Streaming
calibration: bounded memory"): each layer's experts are read once, packed at every width into a work
file (and, with lazy experts, the unquantized reference run through that layer for every window),
and every evaluation runs layer by layer, the windows' hidden states and the layer-input cache in
work files: memory holds the dense weights and one layer's experts, plus per window the reference's
log-probabilities (kl) or top-1 ids. A layer's calls take several windows at once (Calibration.batches:
a window always with the same others, so its bits do not depend on the pass), and the quantized
experts multiply in the type the store's "dequant" path uses on this machine, as the reference's do.

Shapes: T tokens per window, V vocab, D hidden; a key is (layer, expert).
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from edgemoe import kernels
from edgemoe.latency import median_time
from edgemoe.quant import quantize

from edgemoe.experts import DenseExpert, ExpertProvider, InMemoryExperts
from edgemoe.loader import CheckpointExperts, expert_gemm_dtype
from edgemoe.model import MoEModel, Segment
from edgemoe.seq2seq import Seq2SeqModel, text_to_text
from edgemoe.spec import ModelSpec

from .streaming import PackedExperts, WindowStates, WorkDirectory

WIDTHS = (2, 4, 8)
METRICS = ("ppl", "top1", "kl")
IMPORTANCE_METHODS = ("local", "exact")
# Experts on each side of the cut that local importance re-ranks by their exact importance.
BOUNDARY = 8
# Windows go through a layer together, up to this many tokens a call: a layer's matrix products on
# more rows at once (docs/budget.md, "Cheaper passes"); a window's batch is fixed (Calibration.batches).
BATCH_TOKENS = 1024
Key = tuple[int, int]


def sequences(model: MoEModel, sizes: list[int]) -> tuple[torch.Tensor, list[Segment]]:
    """(positions, segments) of windows of these sizes run as one batch, each from position 0 with a
    fresh KV cache of its own: what each window's own forward pass sees."""
    return torch.cat([torch.arange(n) for n in sizes]), [Segment(model.new_cache(), n) for n in sizes]


class MixedWidthExperts(ExpertProvider):
    """Every expert packed at every width in `packed` (a work file); `widths` says which one each
    expert uses now. Dequantized weights are held for one layer and one evaluation at a time: a
    layer-by-layer pass serves every window from them before the next layer's are read. They are
    dequantized to `gemm_dtype`, the type the store's "dequant" path multiplies in on this machine
    (edgemoe.loader.expert_gemm_dtype), so that the twin computes as its unquantized reference does."""

    def __init__(self, packed: PackedExperts, gemm_dtype: torch.dtype = torch.float32):
        self.packed, self.gemm_dtype = packed, gemm_dtype
        self.activations: dict = {}
        self.widths: dict[Key, int] = {}
        self._layer, self._held = None, {}

    def add(self, key: Key, expert: DenseExpert, group_size: int | None, method: str) -> None:
        """Pack `expert` at every width (its float weights are not kept); it starts at 8 bits."""
        for bits in WIDTHS:
            self.packed.add(key, bits, {role: quantize(w, bits, group_size, method)
                                        for role, w in expert.weights.items()})
        self.activations[key] = expert.activation
        self.widths[key] = 8

    def expert(self, layer: int, expert: int) -> DenseExpert:
        return self.at((layer, expert), self.widths[layer, expert])

    def at(self, key: Key, bits: int) -> DenseExpert:
        """The expert `key` quantized at `bits`, dequantized (held until another layer is asked for
        or release())."""
        if key[0] != self._layer:
            self.release()
            self._layer = key[0]
        item = key, bits
        if item not in self._held:
            weights = {role: kernels.dequantize(qt, self.gemm_dtype) for role, qt in self.packed.get(*item).items()}
            self._held[item] = DenseExpert(**weights, activation=self.activations[key])
        return self._held[item]

    def release(self) -> None:
        """Let the dequantized experts go (an evaluation with other widths starts)."""
        self._layer, self._held = None, {}


class LocalErrors(ExpertProvider):
    """The experts as `experts.widths` say (the all-ceiling model), recording each expert's local
    error at `floor` as the layers run: for the tokens routed to it, with routing weights w [S],
    sum |w * (y_floor - y)|^2 over tokens and hidden units, into `errors` (key -> float)."""

    def __init__(self, experts: MixedWidthExperts, floor: int):
        self.experts, self.floor = experts, floor
        self.errors: dict[Key, float] = {}
        self._token_errors: dict[Key, torch.Tensor] = {}

    def expert(self, layer: int, expert: int):
        key = layer, expert
        used, low = self.experts.expert(layer, expert), self.experts.at(key, self.floor)

        def compute(x: torch.Tensor) -> torch.Tensor:
            y = used(x)
            self._token_errors[key] = (low(x) - y).float().square().sum(-1)     # [S]
            return y
        return compute

    def run(self, layer: int, x: torch.Tensor, batches) -> torch.Tensor:
        out = super().run(layer, x, batches)      # asks expert() once per active expert
        for e, _, weights in batches:
            error = (weights.float().square() * self._token_errors.pop((layer, e))).sum().item()
            self.errors[layer, e] = self.errors.get((layer, e), 0.0) + error
        return out


class Calibration:
    """Calibration windows with what the loss needs from the reference model.

    A decoder-only model predicts each window's tokens after the first; an encoder-decoder model
    reads each window as text-to-text (edgemoe.seq2seq.text_to_text: the first half is the encoder's
    input, the second half the decoder's teacher-forced target) and predicts the target's tokens.

    The loss is estimated from a sample of text, so the search judges it by an upper confidence
    bound: per window, the quantized-minus-reference difference (nats per token for ppl, disagreements
    or KL per token otherwise) is a paired sample; bound = mean + z * standard error, z from
    `confidence` (one-sided; 0.5 gives the plain estimate)."""

    def __init__(self, reference: MoEModel | Seq2SeqModel | ModelSpec, ids: torch.Tensor, context: int, metric: str,
                 confidence: float = 0.95):
        """reference: the unquantized model, or only its spec when the reference is computed later:
        by compute_reference, or layer by layer by the search that reads the experts (add_reference)."""
        if metric not in METRICS:
            raise ValueError(f"--metric {metric!r}: expected one of {METRICS}")
        if not 0.5 <= confidence < 1:
            raise ValueError(f"--confidence {confidence}: expected a value in [0.5, 1)")
        self.metric = metric
        self.z = statistics.NormalDist().inv_cdf(confidence)
        self.spec = reference if isinstance(reference, ModelSpec) else reference.spec
        self._use([ids[i:i + context] for i in range(0, ids.numel(), context) if ids.numel() - i >= 2])
        if not self.windows:
            raise ValueError("calibration text: fewer than 2 tokens")
        self.reference: list[torch.Tensor] = []
        self.reference_nll: list[float] = []     # per window, summed over its tokens
        if not isinstance(reference, ModelSpec):
            self.compute_reference(reference)

    def _use(self, windows: list[torch.Tensor]) -> None:
        self.windows = windows
        self.pairs = ([text_to_text(w, self.spec.stacks.decoder_start_token_id) for w in windows]
                      if self.spec.is_encoder_decoder else None)
        self.targets = [p.target for p in self.pairs] if self.pairs else [w[1:] for w in windows]
        self.sizes = [t.numel() for t in self.targets]
        self.tokens = sum(self.sizes)

    def keep(self, indices: list[int]) -> None:
        """Only these windows (increasing indices) from now on; before any reference is added."""
        if self.reference:
            raise ValueError("Calibration.keep: the reference of some windows is computed already")
        if list(indices) != sorted(set(indices)) or not indices or not 0 <= indices[0] <= indices[-1] < len(self.windows):
            raise ValueError(f"Calibration.keep: expected increasing window indices in [0, {len(self.windows)})")
        self._use([self.windows[i] for i in indices])

    def compute_reference(self, model: MoEModel | Seq2SeqModel) -> None:
        """Every window's reference from the unquantized model, loaded whole."""
        pending = {}      # a block's two halves come batch after batch: added in window order
        for batch in self.batches(range(len(self.windows)), BATCH_TOKENS):
            pending.update(zip(batch, self.predict_batch(model, batch)))
            while len(self.reference) in pending:
                self.add_reference(len(self.reference), pending.pop(len(self.reference)))

    @property
    def has_reference(self) -> bool:
        return len(self.reference) == len(self.windows)

    def add_reference(self, i: int, logits: torch.Tensor) -> None:
        """Window i's reference, from the unquantized model's logits [T, V] for it (as predict);
        windows in order."""
        if i != len(self.reference):
            raise ValueError(f"add_reference: window {i} given, window {len(self.reference)} expected")
        logp = torch.log_softmax(logits, dim=-1)    # [T, V]
        self.reference_nll.append(-logp.gather(1, self.targets[i][:, None]).sum().item())
        self.reference.append(logp if self.metric == "kl" else logp.argmax(-1))

    def predict(self, model: MoEModel | Seq2SeqModel, i: int) -> torch.Tensor:
        """The model's logits [T, V] for window i, row t predicting targets[i][t]."""
        if self.pairs:
            return model.teacher_forced(self.pairs[i])
        return model.logits(self.windows[i])[:-1]

    @torch.inference_mode()
    def predict_batch(self, model: MoEModel | Seq2SeqModel, batch: list[int]) -> list[torch.Tensor]:
        """predict for each window of `batch` (one of batches()), a decoder-only model's windows run as
        one batch of sequences: the bits the search's layer-by-layer pass computes for them."""
        if self.pairs:
            return [self.predict(model, i) for i in batch]
        sizes = [self.windows[i].numel() for i in batch]
        hidden = model.run_layers(model.embeddings(torch.cat([self.windows[i] for i in batch])),
                                  *sequences(model, sizes))
        return [model.head(h)[:-1] for h in hidden.split(sizes)]

    def window_loss(self, i: int, logits: torch.Tensor) -> float:
        """This window's loss from logits [T, V] aligned with its targets (predict), summed over its
        tokens (for ppl: NLL minus the reference's NLL)."""
        logp = torch.log_softmax(logits, dim=-1)
        if self.metric == "ppl":
            return -logp.gather(1, self.targets[i][:, None]).sum().item() - self.reference_nll[i]
        if self.metric == "top1":
            return (logp.argmax(-1) != self.reference[i]).sum().item()
        ref = self.reference[i]
        return (ref.exp() * (ref - logp)).sum().item()

    def halves(self) -> tuple[list[int], list[int]]:
        """Window indices split in two interleaved halves: one ranks the experts, the other chooses
        how many go down, so the choice is not biased by the ranking's own noise."""
        every = list(range(len(self.windows)))
        if len(every) < 2:
            return every, every
        return every[0::2], every[1::2]

    def batches(self, windows, tokens: int) -> list[list[int]]:
        """`windows` in batches of up to `tokens` tokens (one window at least) to run through a layer
        together. A window's batch is the windows of its own half (halves) in its block of
        consecutive windows, whichever of them are asked for: a pass over all the windows and a pass
        over its half put it in the same batch, so it computes the same bits in both (a batched
        matrix product may round a row differently with other rows beside it)."""
        per_batch = max(1, tokens // self.windows[0].numel())
        batches: dict[tuple[int, int], list[int]] = {}
        for i in windows:
            batches.setdefault((i // (2 * per_batch), i % 2), []).append(i)
        return list(batches.values())

    def loss(self, per_window: dict[int, float]) -> tuple[float, float]:
        """(estimate, upper confidence bound) of the metric from per-window sums (window -> sum)."""
        sizes = [self.sizes[i] for i in per_window]
        mean = sum(per_window.values()) / sum(sizes)
        rates = [v / n for v, n in zip(per_window.values(), sizes)]
        se = statistics.stdev(rates) / math.sqrt(len(rates)) if len(rates) > 1 else 0.0
        bound = mean + self.z * se
        if self.metric == "ppl":
            return math.exp(mean) - 1, math.exp(bound) - 1
        return mean, bound


# A time target keeps no fewer calibration windows than this (or all there are): the confidence
# bound needs a spread over windows, and each half (Calibration.halves) gets 8 of them.
MIN_SAMPLE_WINDOWS = 16


@dataclass(frozen=True)
class WindowSample:
    """The calibration windows a time target let the search use (sample_for_time; manifest.json's
    budget.sample)."""

    minutes: float
    windows: int                # windows used
    of: int                     # windows given
    tokens: int                 # predicted tokens in the windows used
    of_tokens: int              # and in those given
    seconds_per_token: float    # one pass of the search, measured here
    passes: float               # projected_passes

    def projected_seconds(self, tokens: int | None = None) -> float:
        return self.passes * self.seconds_per_token * (self.tokens if tokens is None else tokens)

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "projected_seconds": self.projected_seconds(),
                "projected_seconds_all": self.projected_seconds(self.of_tokens)}


def projected_passes(moe_layers: int, experts: int, importance: str) -> float:
    """Passes over all the calibration windows the search makes on its usual longest path (ceiling
    INT8), a re-run from layer l of L on half the windows counting (L - l) / L / 2: the reference, the
    three uniform stores, the importance (local: its probe, 0.75, and one re-run per layer; exact:
    the inputs cached on half the windows and one re-run per expert), the count search on half the
    windows (a binary search's count), for local importance the boundary's re-runs and its count
    search, and the chosen mix checked on the other half (docs/budget.md, "Cost at the scale of real
    models")."""
    def count_search(n: int) -> float:
        return math.ceil(math.log2(n + 1)) / 2

    common = 1 + 3 + count_search(experts) + 0.5
    if importance == "exact":
        return common + 0.5 + experts / 4
    band = min(2 * BOUNDARY, experts)
    return common + 0.75 + (moe_layers + 1) / 4 + band / 4 + count_search(band)


@torch.inference_mode()
def pass_seconds_per_token(model: MoEModel | Seq2SeqModel, calib: Calibration) -> float:
    """Wall seconds one pass of the search spends per calibration token on this machine, measured on
    the first batch of windows (Calibration.batches): a decoder-only model's through its first layer,
    counted once per layer (its layers cost alike), and its head; an encoder-decoder model's whole
    forward pass over its first window (it runs window by window). Each is the median of three
    timed runs after a first, which reads a lazy model's experts (held for that layer, where the
    search reads them next) and warms the threads: a single timing moved by a fifth between converts
    on two threads (docs/budget.md, "The time target")."""
    if isinstance(model, Seq2SeqModel):     # its windows run one at a time: the first one
        return median_time(lambda: calib.predict(model, 0), 3) / calib.sizes[0]
    batch = calib.batches(range(len(calib.windows)), BATCH_TOKENS)[0]
    tokens = sum(calib.sizes[i] for i in batch)
    model.threads.step()
    sizes = [calib.windows[i].numel() for i in batch]
    x = model.embeddings(torch.cat([calib.windows[i] for i in batch]))
    layer = median_time(lambda: model.run_layers(x, *sequences(model, sizes), start=0, stop=1), 3)
    head = median_time(lambda: model.head(x), 3)
    return (model.spec.num_layers * layer + head) / tokens


def spread(count: int, total: int) -> list[int]:
    """`count` indices of range(total), evenly spread: the middle of each of `count` equal parts."""
    return [(2 * j + 1) * total // (2 * count) for j in range(count)]


def sample_for_time(model: MoEModel | Seq2SeqModel, calib: Calibration, minutes: float,
                    importance: str = "local") -> WindowSample:
    """Keep as many of calib's windows, evenly spread over the text, as let the search's projected
    time (projected_passes x pass_seconds_per_token x tokens) fit `minutes`, MIN_SAMPLE_WINDOWS at
    least (or all there are); all of them where the projection fits. Before any reference is added."""
    if not minutes > 0:
        raise ValueError(f"search minutes={minutes}: expected a time above 0")
    per_token = pass_seconds_per_token(model, calib)
    spec = model.spec
    layers = len(spec.moe_layer_ids)
    passes = projected_passes(layers, layers * spec.num_experts, importance)
    given, given_tokens = len(calib.windows), calib.tokens
    per_window = passes * per_token * given_tokens / given
    used = min(given, max(MIN_SAMPLE_WINDOWS, int(minutes * 60 / per_window)))
    if used < given:
        calib.keep(spread(used, given))
    return WindowSample(minutes, used, given, calib.tokens, given_tokens, per_token, passes)


@dataclass
class BudgetResult:
    metric: str
    budget: float
    widths: dict[Key, int]
    floor: int
    ceiling: int
    uniform_loss: dict[int, float]
    importance: dict[Key, float]
    importance_method: str
    loss: float                       # calibration loss of the chosen widths (estimate)
    loss_bound: float                 # its upper confidence bound, which the budget constrains
    moved_down: int                   # experts at the floor
    feasible: bool                    # False: even all-8 exceeds the budget
    evaluations: int
    seconds: dict[str, float] = field(default_factory=dict)
    layer_loss: dict[int, float] = field(default_factory=dict)   # local: a group's first layer -> the loss
    layer_groups: list[list[int]] = field(default_factory=list)  # with the group at the floor; the groups
    boundary: dict[Key, float] = field(default_factory=dict)     # local: exact importance near the cut

    def to_json(self) -> dict:
        return {"metric": self.metric, "budget": self.budget, "floor": self.floor, "ceiling": self.ceiling,
                "feasible": self.feasible, "calibration_loss": self.loss, "calibration_loss_bound": self.loss_bound,
                "moved_down": self.moved_down,
                "uniform_loss": {str(b): v for b, v in self.uniform_loss.items()},
                "importance": _by_layer(self.importance), "importance_method": self.importance_method,
                "layer_loss": {str(l): v for l, v in self.layer_loss.items()}, "layer_groups": self.layer_groups,
                "boundary": [[l, e, v] for (l, e), v in sorted(self.boundary.items())],
                "widths": _by_layer(self.widths),
                "evaluations": self.evaluations, "seconds": self.seconds}


def _by_layer(values: dict[Key, float]) -> dict[str, list]:
    layers = sorted({l for l, _ in values})
    return {str(l): [values[l, e] for e in sorted(e for ll, e in values if ll == l)] for l in layers}


class BudgetSearch:
    """The search on a MoEModel or a Seq2SeqModel. A MoEModel is evaluated layer by layer (every
    window through one layer, then the next: exactly each window's forward pass), its windows'
    hidden states and the per-layer input cache of the importance step's re-runs in work files.
    A Seq2SeqModel runs whole (encoder and decoder) per window and evaluation: its decoder layers
    also read the encoder's output, which one cached input per layer does not carry.

    model: loaded whole (InMemoryExperts) or, for a MoEModel, with its experts read lazily from the
    checkpoint (CheckpointExperts, model_from_checkpoint(lazy_experts=True)): with a Calibration that
    awaits its reference (built from the spec), the reference is run layer by layer as the experts
    are read. workdir: where the work files go (a directory made inside it, removed by close()).
    batch_tokens: windows go through a layer's calls together up to this many tokens (0: one window
    a call, as before batching). gemm_dtype: the type the quantized experts multiply in (default the
    store's "dequant" path's on this machine; float32 as before). Use as a context manager, or
    close() it."""

    def __init__(self, model: MoEModel | Seq2SeqModel, calibration: Calibration, group_size: int | None = None,
                 method: str = "rtn", progress: Callable[[str, int, int], None] | None = None,
                 importance: str = "local", workdir=None, sensitivity_groups: int | None = None,
                 batch_tokens: int = BATCH_TOKENS, gemm_dtype: torch.dtype | None = None):
        if not isinstance(model.experts, (InMemoryExperts, CheckpointExperts)):
            raise ValueError("budget search: load the checkpoint directory, not a store")
        if importance not in IMPORTANCE_METHODS:
            raise ValueError(f"--importance {importance!r}: expected one of {IMPORTANCE_METHODS}")
        self._resumable = isinstance(model, MoEModel)
        if not (calibration.has_reference or self._resumable):
            raise ValueError("budget search: an encoder-decoder model's reference needs the model loaded whole")
        if sensitivity_groups is not None and sensitivity_groups < 1:
            raise ValueError(f"sensitivity_groups={sensitivity_groups}: expected at least 1")
        self.model, self.calib, self.importance_method = model, calibration, importance
        self.sensitivity_groups = sensitivity_groups
        self.progress = progress or (lambda stage, done, total: None)
        spec = model.spec
        self.keys = [(layer, e) for layer in sorted(spec.moe_layer_ids) for e in range(spec.num_experts)]
        self.evaluations = 0
        self._window_losses: dict[tuple, dict[int, float]] = {}     # widths -> window -> loss (loss())
        self._inputs_hold = None      # (widths, windows) whose layer inputs are cached for re-runs
        self.layer_loss: dict[int, float] = {}
        self.boundary: dict[Key, float] = {}
        self._counts_tried: set[int] = set()     # counts at the floor evaluated by this run's searches
        self._work = WorkDirectory(workdir)
        self.batch_tokens = batch_tokens
        self.experts = MixedWidthExperts(PackedExperts(self._work.path / "packed.bin"),
                                         gemm_dtype or expert_gemm_dtype(model.dense_weights()))
        self._quantized = type(model)(spec, model.dense_weights(), self.experts)
        if self._resumable:
            sizes, dtype = [w.numel() for w in calibration.windows], self._quantized.dtype
            self._states = WindowStates(self._work.path / "states.bin", sizes, spec.hidden_size, dtype)
            self._inputs = WindowStates(self._work.path / "inputs.bin", sizes, spec.hidden_size, dtype,
                                        slots=spec.num_layers)
        try:
            start = time.perf_counter()
            self._read_experts(model.experts, group_size, method)
            self._reading_seconds = time.perf_counter() - start
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> "BudgetSearch":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Remove the work files (the packed experts with them)."""
        self.experts.packed.close()
        if self._resumable:
            self._states.close()
            self._inputs.close()
        self._work.close()

    def _read_experts(self, source, group_size: int | None, method: str) -> None:
        """Each MoE layer's experts read once from `source` and packed at every width; when the
        calibration awaits its reference, the unquantized model run through each layer as it is read
        (every layer, those without experts included), and the reference taken from its head."""
        run_reference = not self.calib.has_reference
        windows = range(len(self.calib.windows))
        moe_layers = sorted({l for l, _ in self.keys})
        layers = range(self.model.spec.num_layers) if run_reference else moe_layers
        if run_reference:
            self._embed(windows, 0)
        for done, layer in enumerate(layers, 1):
            for key in (k for k in self.keys if k[0] == layer):
                self.experts.add(key, source.expert(*key), group_size, method)
            if run_reference:
                self._quantized.experts = source     # the unquantized experts of this layer
                try:
                    self._through_layer(layer, windows)
                finally:
                    self._quantized.experts = self.experts
            self.progress("reading experts", done, len(layers))
        for i in windows if run_reference else ():
            self.calib.add_reference(i, self._logits(i))

    def uniform(self, bits: int) -> tuple[float, float]:
        """(estimate, upper bound) of the calibration loss with every expert at `bits`, all windows."""
        return self.loss({key: bits for key in self.keys})

    def loss(self, widths: dict[Key, int], start_layer: int = 0, windows=None,
             record_inputs: bool = False) -> tuple[float, float]:
        """(estimate, upper bound) of the calibration loss with these widths over `windows` (default
        all); computed from `start_layer` on the cached layer inputs when > 0 (MoEModel only).
        A window's loss under given widths is computed once: a later call reuses it (the pass runs
        the other windows only, and none when every one is known). record_inputs: run every window
        anew from layer 0, known or not (the local probe records as it runs), and cache each layer's
        inputs for re-runs (MoEModel only)."""
        windows = range(len(self.calib.windows)) if windows is None else windows
        signature = self._signature(widths)
        known = self._window_losses.setdefault(signature, {})
        todo = list(windows) if record_inputs else [i for i in windows if i not in known]
        if todo:
            self.experts.widths = widths
            self.evaluations += 1
            if self._resumable:
                self._pass(todo, 0 if record_inputs else start_layer, record_inputs)
                known.update({i: self.calib.window_loss(i, self._logits(i)) for i in todo})
            else:
                self.experts.release()
                known.update({i: self.calib.window_loss(i, self.calib.predict(self._quantized, i)) for i in todo})
            if record_inputs:
                self._inputs_hold = signature, frozenset(todo)
        return self.calib.loss({i: known[i] for i in windows})

    def _signature(self, widths: dict[Key, int]) -> tuple:
        """The widths as a hashable key, in self.keys's order."""
        return tuple(widths[key] for key in self.keys)

    def _pass(self, windows, start_layer: int = 0, record_inputs: bool = False) -> None:
        """Every one of `windows` through layers start_layer.. of the twin, layer by layer; from the
        cached inputs of start_layer when > 0. record_inputs: cache each layer's inputs."""
        self.experts.release()
        self._embed(windows, start_layer)
        for layer in range(start_layer, self.model.spec.num_layers):
            self._through_layer(layer, windows, record_inputs)

    @torch.inference_mode()
    def _embed(self, windows, start_layer: int) -> None:
        for i in windows:
            self._states.write(i, self._quantized.embeddings(self.calib.windows[i]) if start_layer == 0
                               else self._inputs.read(i, start_layer))

    @torch.inference_mode()
    def _through_layer(self, layer: int, windows, record_inputs: bool = False) -> None:
        """Each window's hidden states through `layer` (its own attention, a fresh KV cache: what
        its whole forward pass computes there), in batches of windows (Calibration.batches)."""
        m = self._quantized
        m.threads.step()
        for batch in self.calib.batches(windows, self.batch_tokens):
            states = [self._states.read(i) for i in batch]
            if record_inputs:
                for i, x in zip(batch, states):
                    self._inputs.write(i, x, layer)
            sizes = [x.shape[0] for x in states]
            out = m.run_layers(torch.cat(states), *sequences(m, sizes), start=layer, stop=layer + 1)
            for i, x in zip(batch, out.split(sizes)):
                self._states.write(i, x)

    @torch.inference_mode()
    def _logits(self, i: int) -> torch.Tensor:
        """Window i's logits from its last layer's output, aligned with its targets (as predict)."""
        return self._quantized.head(self._states.read(i))[:-1]

    def _cache_layer_inputs(self, widths: dict[Key, int], windows=None) -> None:
        """Make sure the input to every layer of each of `windows` (default all) under `widths` (the
        all-ceiling model) is cached, for re-runs from a layer (MoEModel; a Seq2SeqModel re-runs
        whole): one pass, unless that cache holds them already."""
        windows = range(len(self.calib.windows)) if windows is None else windows
        if self._resumable and self._inputs_hold != (self._signature(widths), frozenset(windows)):
            self.loss(widths, windows=windows, record_inputs=True)

    def importance(self, floor: int, ceiling: int, windows=None) -> dict[Key, float]:
        """Each expert's importance on `windows`, by self.importance_method (module docstring)."""
        base = {key: ceiling for key in self.keys}
        if self.importance_method == "exact":
            self._cache_layer_inputs(base, windows)
            return self._exact_importance(base, floor, windows)
        return self._local_importance(base, floor, windows)

    def _exact_importance(self, base: dict[Key, int], floor: int, windows, keys=None,
                          stage: str = "importance") -> dict[Key, float]:
        """Each of `keys` (default all) alone at the floor: the loss change."""
        keys = self.keys if keys is None else keys
        base_loss = self.loss(base, windows=windows)[0]
        scores = {}
        for i, key in enumerate(keys):
            loss = self.loss({**base, key: floor}, start_layer=self._start(key[0]), windows=windows)[0]
            scores[key] = loss - base_loss
            self.progress(stage, i + 1, len(keys))
        return scores

    def layer_groups(self) -> list[list[int]]:
        """The MoE layers in at most self.sensitivity_groups runs of consecutive layers, as equal in
        length as they divide (one layer each when there are no more layers than groups, or no
        number of groups is set: the default)."""
        layers = sorted({l for l, _ in self.keys})
        n = min(self.sensitivity_groups or len(layers), len(layers))
        return [layers[len(layers) * g // n:len(layers) * (g + 1) // n] for g in range(n)]

    def _local_importance(self, base: dict[Key, int], floor: int, windows) -> dict[Key, float]:
        """Local error x its layer group's sensitivity; sets self.layer_loss (a group's first layer ->
        loss change with the whole group at the floor)."""
        probe = LocalErrors(self.experts, floor)
        self._quantized.experts = probe
        try:     # the probe's pass caches the layer inputs of the re-runs that follow
            base_loss = self.loss(base, windows=windows, record_inputs=True)[0]
        finally:
            self._quantized.experts = self.experts
        groups = self.layer_groups()
        # Progress in layers computed, so that the bar's rate (and time left) holds: a re-run from a
        # late layer computes fewer layers than one from an early layer.
        work = [self.model.spec.num_layers - self._start(group[0]) for group in groups]
        self.layer_loss, scores = {}, {}
        for g, group in enumerate(groups):
            down = {key: floor for key in self.keys if key[0] in group}
            loss = self.loss({**base, **down}, start_layer=self._start(group[0]), windows=windows)[0]
            self.layer_loss[group[0]] = loss - base_loss
            errors = {key: probe.errors.get(key, 0.0) for key in down}
            total = sum(errors.values())
            # A group whose drop did not raise the loss measured nothing to scale by: its experts score 0.
            sensitivity = max(self.layer_loss[group[0]], 0.0) / total if total > 0 else 0.0
            scores.update({key: sensitivity * error for key, error in errors.items()})
            self.progress("importance", sum(work[:g + 1]), sum(work))
        return scores

    def _start(self, layer: int) -> int:
        """The layer a re-run may start from: `layer` on cached inputs, else 0 (Seq2SeqModel)."""
        return layer if self._resumable else 0

    def run(self, budget: float) -> BudgetResult:
        if budget < 0:
            raise ValueError(f"--budget {budget}: expected >= 0")
        seconds: dict[str, float] = {"reading": self._reading_seconds}    # the reference pass's too, if run there
        start = time.perf_counter()
        self.layer_loss, self.boundary, self._counts_tried = {}, {}, set()
        uniform = {}
        for bits in WIDTHS:      # narrowest first: the first within the budget is the ceiling
            uniform[bits] = self.uniform(bits)
            holds = uniform[bits][1] <= budget
            self.progress("uniform widths", len(uniform), len(uniform) if holds else len(WIDTHS))
            if holds:
                break
        seconds["uniform"] = time.perf_counter() - start
        within = [b for b in uniform if uniform[b][1] <= budget]
        ceiling = within[0] if within else WIDTHS[-1]
        result = dict(metric=self.calib.metric, budget=budget, ceiling=ceiling,
                      uniform_loss={b: v[0] for b, v in uniform.items()}, feasible=bool(within))
        if ceiling == WIDTHS[0] or not within:
            widths = {key: ceiling for key in self.keys}
            return BudgetResult(widths=widths, floor=ceiling, importance={}, importance_method=self.importance_method,
                                loss=uniform[ceiling][0],
                                loss_bound=uniform[ceiling][1], moved_down=0, evaluations=self.evaluations,
                                seconds=seconds, **result)
        floor = WIDTHS[WIDTHS.index(ceiling) - 1]
        t = time.perf_counter()
        ranking, choosing = self.calib.halves()
        importance = self.importance(floor, ceiling, ranking)
        seconds["importance"] = time.perf_counter() - t
        t = time.perf_counter()
        order = sorted(self.keys, key=lambda k: (importance[k], k))
        k = self._largest_k(order, floor, ceiling, budget, choosing, scores=importance)
        if self.importance_method == "local":
            order, k = self._refine_boundary(order, k, floor, ceiling, budget, ranking, choosing, importance)
        widths, k, loss, bound = self._holding_on_all_windows(order, k, floor, ceiling, budget)
        seconds["search"] = time.perf_counter() - t
        seconds["total"] = time.perf_counter() - start
        widths = {key: widths[key] for key in self.keys}
        return BudgetResult(widths=widths, floor=floor, importance=importance, importance_method=self.importance_method,
                            loss=loss, loss_bound=bound, moved_down=k, evaluations=self.evaluations,
                            seconds=seconds, layer_loss=self.layer_loss, layer_groups=self.layer_groups() if self.layer_loss else [],
                            boundary=self.boundary, **result)

    def _holding_on_all_windows(self, order: list[Key], k: int, floor: int, ceiling: int, budget: float):
        """(widths, K, loss, bound) of the K least important at the floor on the whole calibration
        text: chosen on half the windows, the mix must hold on all of them too, so that the bound
        recorded is the one the budget constrains. Where K does not hold, fewer experts go down: the
        count is searched by galloping down from K (K-1, K-2, K-4, ...) and bisecting the last gap,
        so a mix that holds only far below K costs a few evaluations (each a full pass), not one per
        expert; where the loss falls as K falls, this finds the K a walk of one expert at a time would
        (K = 0, the uniform ceiling, holds: the ceiling was chosen by its bound on all windows)."""
        def evaluate(count):
            widths = {key: (floor if i < count else ceiling) for i, key in enumerate(order)}
            return (widths, count, *self.loss(widths))

        chosen = evaluate(k)
        if chosen[3] <= budget or k == 0:
            return chosen
        failing, held, step = k, None, 1
        while held is None:
            candidate = evaluate(max(0, k - step))
            if candidate[3] <= budget or candidate[1] == 0:
                held = candidate
            else:
                failing, step = candidate[1], step * 2
        while failing - held[1] > 1:
            candidate = evaluate((held[1] + failing) // 2)
            if candidate[3] <= budget:
                held = candidate
            else:
                failing = candidate[1]
        return held

    def _refine_boundary(self, order: list[Key], k: int, floor: int, ceiling: int, budget: float, ranking,
                         choosing, importance: dict[Key, float]) -> tuple[list[Key], int]:
        """The local ranking's errors cost store size only near the cut: the BOUNDARY experts on each
        side of position k are re-ranked by their exact importance (on the ranking windows), and K
        searched again among them. Sets self.boundary (key -> exact importance)."""
        low, high = max(0, k - BOUNDARY), min(len(order), k + BOUNDARY)
        band = order[low:high]
        base = {key: ceiling for key in self.keys}
        self._cache_layer_inputs(base, ranking)
        self.boundary = self._exact_importance(base, floor, ranking, band, stage="boundary")
        order = order[:low] + sorted(band, key=lambda key: (self.boundary[key], key)) + order[high:]
        return order, self._largest_k(order, floor, ceiling, budget, choosing, low, high,
                                      {**importance, **self.boundary})

    def _largest_k(self, order: list[Key], floor: int, ceiling: int, budget: float, windows, lo: int = 0,
                   hi: int | None = None, scores: dict[Key, float] | None = None) -> int:
        """The largest K in [lo, hi] with the K least important at the floor within the budget on
        `windows` (K = lo is known to be within it: the uniform ceiling for lo = 0). Each step
        evaluates the count the ranking predicts (interpolated_count) between the nearest counts
        measured on each side, or bisects where no such pair is known or the last two predictions
        left more than half their bracket: the answer of a binary search where the loss grows with
        the count, in 2 evaluations where the prediction is true and at most about three times a
        binary search's where it is false. scores: the importance that ordered `order` (None: bisect every step)."""
        def widths_for(k):
            return {key: (floor if i < k else ceiling) for i, key in enumerate(order)}

        hi = len(order) if hi is None else hi      # lo is within the budget; hi is unknown
        position = None if scores is None else list(
            itertools.accumulate((max(scores[key], 0.0) for key in order), initial=0.0))
        steps, total = 0, max(1, math.ceil(math.log2(hi - lo + 1)))
        widths_seen, predicted = [], []     # the bracket's width before each step; whether it predicted
        while lo < hi:
            measured = self._measured_counts(widths_for, windows, len(order))
            lo, hi = bracket(measured, budget, lo, hi)
            if lo == hi:
                break
            # Two predictions in a row must halve the bracket, else bisect: a prediction that holds
            # is followed by the count above it, which ends the search where the prediction was true.
            stalled = predicted[-2:] == [True, True] and 2 * (hi - lo) > widths_seen[-2]
            guess = None if stalled or position is None else interpolated_count(position, budget, lo, hi, measured)
            widths_seen.append(hi - lo)
            predicted.append(guess is not None)
            mid = (lo + hi + 1) // 2 if guess is None else guess
            self._counts_tried.add(mid)
            if self.loss(widths_for(mid), windows=windows)[1] <= budget:
                lo = mid
            else:
                hi = mid - 1
            steps += 1
            self.progress("search", min(steps, total), total)
        return lo

    def _measured_counts(self, widths_for, windows, count_all: int) -> dict[int, float]:
        """count -> bound on `windows`, for the counts (under this order) whose losses are kept: the
        uniform ends and those this run's searches tried."""
        measured = {}
        for k in sorted(self._counts_tried | {0, count_all}):
            kept = self._kept_loss(widths_for(k), windows)
            if kept is not None:
                measured[k] = kept[1]
        return measured

    def _kept_loss(self, widths: dict[Key, int], windows) -> tuple[float, float] | None:
        """loss(widths, windows=windows) where every window's loss is kept (so it runs nothing), else None."""
        known = self._window_losses.get(self._signature(widths), {})
        return self.loss(widths, windows=windows) if all(i in known for i in windows) else None


def bracket(measured: dict[int, float], budget: float, lo: int, hi: int) -> tuple[int, int]:
    """[lo, hi] narrowed by the measured counts (count -> bound) inside it: one over the budget
    lowers hi below it, one within raises lo to it (as if a binary search had evaluated them)."""
    hi = min([hi] + [k - 1 for k, bound in measured.items() if lo < k <= hi and bound > budget])
    return max([lo] + [k for k, bound in measured.items() if lo < k <= hi and bound <= budget]), hi


def interpolated_count(position: list[float], budget: float, lo: int, hi: int,
                       measured: dict[int, float]) -> int | None:
    """The count in (lo, hi] the ranking predicts to be the last within the budget, or None.

    position[K]: the summed importance of the K least important experts (nondecreasing), which
    predicts the loss up to scale. measured: count -> measured bound (those inside (lo, hi] unused).
    Between the largest measured count at or below lo within the budget and the smallest above hi
    over it, the bound is taken as linear in position; the prediction is the largest count whose
    position reaches no further than the budget's, clamped into (lo, hi]. None where either side has
    no measured count or the two do not rise."""
    below = [k for k, bound in measured.items() if k <= lo and bound <= budget]
    above = [k for k, bound in measured.items() if k > hi and bound > budget]
    if not below or not above:
        return None
    a, b = max(below), min(above)
    rise = measured[b] - measured[a]
    if rise <= 0 or position[b] <= position[a]:
        return None
    target = position[a] + (budget - measured[a]) / rise * (position[b] - position[a])
    return min(max(bisect.bisect_right(position, target) - 1, lo + 1), hi)


def parse_budget(text: str) -> float:
    """'5%' -> 0.05, '0.05' -> 0.05 (a fraction), for --budget."""
    value = text.strip()
    try:
        limit = float(value[:-1]) / 100 if value.endswith("%") else float(value)
    except ValueError:
        limit = math.nan
    if not math.isfinite(limit):
        raise ValueError(f"--budget {text!r}: expected a percentage like 5% or a number like 0.05")
    return limit


def heldout_loss(model: Seq2SeqModel, reference: Seq2SeqModel, ids: torch.Tensor, context: int, metric: str) -> float:
    """An encoder-decoder store's loss on held-out text: the calibration loss's estimate (not its
    bound), windows as the calibration's, against the reference model."""
    heldout = Calibration(reference, ids, context, metric, confidence=0.5)
    return heldout.loss({i: heldout.window_loss(i, heldout.predict(model, i)) for i in range(len(heldout.windows))})[0]


def metric_loss(result, metric: str) -> float:
    """The loss of an evaluate() result against its reference, for the metric."""
    if metric == "ppl":
        return result.perplexity / result.reference_perplexity - 1
    if metric == "top1":
        return 1 - result.top1_agreement
    return result.kl
