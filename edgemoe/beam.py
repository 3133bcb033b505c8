"""Beam search, every live beam batched through each layer: one forward step per new token for all
beams, so each expert the beams choose is read once per step for all of them.

Semantics are transformers' beam search (`generate(num_beams=N, do_sample=False)`): scores are
summed float32 log-probabilities; each step keeps the best K = max(2, 1 + stop tokens) * N
continuations of all beams; a continuation among the best N that ends in a stop token (or reaches
the last allowed token) is a finished hypothesis scored sum_logprobs / generated_length **
length_penalty (the length counts the stop token); the next beams are the best N unfinished ones.
The search ends at the token limit, or once N hypotheses are finished and either early_stopping is
set or the best live beam, scored at its current length, cannot beat the worst finished one.

Shapes: N beams, V vocabulary, K candidates per step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from .generate import Feed, Generation, GenerationOptions, forward_step, last_logits
from .kv_cache import KVCache
from .model import MoEModel
from .options import finite_number, integer_at_least


@dataclass
class Beam:
    tokens: list[int]     # generated so far
    score: float          # summed log-probabilities (float32 value)
    cache: KVCache        # holds the prompt and every token but the last of `tokens`


def beam_search(model: MoEModel, prompt_ids: Sequence[int], num_beams: int, max_new_tokens: int,
                length_penalty: float = 1.0, early_stopping: bool = False,
                stop_token_ids: Sequence[int] | None = None, truncate: bool = False,
                warn: Callable[[str], None] | None = None) -> list[tuple[list[int], float]]:
    """The finished hypotheses, best first (at most num_beams): (new token ids without the stop
    token, score). The prompt goes through generate's loop as one Generation (its context, token limit
    and stop tokens; prefilled once, in chunks), its cache forked per beam; the beams are then fed
    through forward_step together, one step per token. stop_token_ids None: the model's eos tokens."""
    num_beams = integer_at_least(num_beams, "num_beams=", 1)
    max_new_tokens = integer_at_least(max_new_tokens, "max_new_tokens=", 0)
    length_penalty = finite_number(length_penalty, "length_penalty=")
    generation = Generation(model, prompt_ids, GenerationOptions(max_new_tokens=max_new_tokens, truncate=truncate,
                                                                 stop_token_ids=stop_token_ids), warn)
    if generation.finished:
        return []
    logits = last_logits(model, generation.open())[None]          # [1, V]
    search = _Search(num_beams, generation.limit, length_penalty, early_stopping, set(generation.stops))
    beams = [Beam([], 0.0, generation.feed.state)]
    model.timings.first_token_chosen()
    while True:
        beams = search.step(beams, logits)
        if search.done(beams):
            break
        logits = torch.stack(forward_step(model, [Feed(b.cache, b.tokens[-1:], 1) for b in beams]))
    limit = generation.limit
    if limit < max_new_tokens and any(len(tokens) == limit for tokens, _ in search.finished):
        generation.warn(f"beams stopped at the model's context of {model.context_length} tokens")
    return search.finished


class _Search:
    """The beams' bookkeeping: candidates, finished hypotheses, the done rule."""

    def __init__(self, num_beams: int, limit: int, length_penalty: float, early_stopping: bool, stops: set[int]):
        self.num_beams, self.limit = num_beams, limit
        self.length_penalty, self.early_stopping, self.stops = length_penalty, early_stopping, stops
        self.keep = max(2, 1 + len(stops)) * num_beams
        self.finished: list[tuple[list[int], float]] = []   # best first, at most num_beams

    def step(self, beams: list[Beam], logits: torch.Tensor) -> list[Beam]:
        """Beams after one token: logits [len(beams), V] -> the next beams (their caches reused for a
        parent's first pick, forked for its others); finished hypotheses recorded."""
        scores = torch.tensor([b.score for b in beams], dtype=torch.float32)
        totals = (torch.log_softmax(logits.float(), dim=-1) + scores[:, None]).reshape(-1)   # [len(beams) * V]
        best, index = torch.topk(totals, min(self.keep, totals.numel()))
        vocab = logits.shape[-1]
        length = len(beams[0].tokens) + 1
        last = length == self.limit
        new_finished, chosen = [], []
        for rank, (total, flat) in enumerate(zip(best, index.tolist())):
            parent, token = beams[flat // vocab], flat % vocab
            if token in self.stops or last:
                if rank < self.num_beams:      # only the best N may finish (the rest are spares)
                    kept = parent.tokens if token in self.stops else parent.tokens + [token]
                    new_finished.append((kept, float(total / length ** self.length_penalty)))
            elif len(chosen) < self.num_beams:
                chosen.append((parent, token, float(total)))
        self._record(new_finished)
        return [] if last else self._next_beams(chosen)

    def _record(self, hypotheses: list[tuple[list[int], float]]) -> None:
        merged = self.finished + hypotheses
        self.finished = sorted(merged, key=lambda h: h[1], reverse=True)[:self.num_beams]

    @staticmethod
    def _next_beams(chosen: list[tuple[Beam, int, float]]) -> list[Beam]:
        used: set[int] = set()
        beams = []
        for parent, token, score in chosen:
            cache = parent.cache.fork() if id(parent) in used else parent.cache
            used.add(id(parent))
            beams.append(Beam(parent.tokens + [token], score, cache))
        return beams

    def done(self, beams: list[Beam]) -> bool:
        if not beams:
            return True
        if len(self.finished) < self.num_beams:
            return False
        if self.early_stopping:
            return True
        # Scored at its current length, as transformers does (not the longest it could reach), and
        # in float32 like its scores, so that a tie falls the same way.
        length = len(beams[0].tokens)
        best_live = float(torch.tensor(beams[0].score, dtype=torch.float32) / length ** self.length_penalty)
        return best_live <= self.finished[-1][1]
