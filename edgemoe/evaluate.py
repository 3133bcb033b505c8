"""Quality metrics on a text: perplexity (sliding window) and, against a reference model, top-1
next-token agreement and mean KL divergence KL(reference || model).

Windows: the text's tokens (no special tokens added) are cut into windows of `context` tokens that
start every `stride` tokens; each token is scored once, in the first window where it is not among
the first context - stride positions (so every scored token but the first window's sees at least
context - stride tokens before it). Each window starts from an empty KV cache.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Callable, Iterator

import torch

from .errors import EdgeMoEError
from .model import MoEModel
from .options import OptionError, integer_at_least, window_length


@dataclass
class EvalResult:
    tokens: int                  # tokens scored
    context: int
    stride: int
    perplexity: float
    nll: float                   # mean negative log-likelihood, nats per token
    top1_agreement: float | None = None   # with --reference
    kl: float | None = None               # mean KL(reference || model), nats per token
    reference_perplexity: float | None = None

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}


def windows(n_tokens: int, context: int, stride: int) -> Iterator[tuple[int, int, int]]:
    """(begin, end, first scored position) of each window; every position >= 1 scored exactly once,
    always with at least one token of the window before it."""
    if not 0 < stride <= context:
        raise ValueError(f"stride must be in [1, context={context}], got {stride}")
    scored_up_to = 1  # position 0 has no prediction
    begin = 0
    while scored_up_to < n_tokens:
        end = min(begin + context, n_tokens)
        yield begin, end, scored_up_to
        scored_up_to = end
        begin = min(begin + stride, end - 1)  # a window's first token is context only: overlap by one


DEFAULT_CONTEXT = 1024   # a window's tokens when the caller gives none (or the model's context, if shorter)


def default_context(model: MoEModel) -> int:
    return min(model.context_length, DEFAULT_CONTEXT)


def _log_probs(model: MoEModel, ids: torch.Tensor, begin: int, end: int, first: int,
               decode: bool = False) -> torch.Tensor:
    """Log-probabilities [n, V] predicting positions first..end-1 from the window begin..end-1. With
    `decode`, the window's context (begin..first-1) is one prefill step and every scored position
    one step of its own through the KV cache, as generation runs (for options that act per step)."""
    if not decode:
        logits = model.logits(ids[begin:end - 1])        # row j predicts position begin + j + 1
        return torch.log_softmax(logits[first - begin - 1:], dim=-1)
    cache = model.new_cache()
    rows = [model.logits(ids[begin:first], cache)[-1:]]   # predicts position first
    rows += [model.logits(ids[p:p + 1], cache) for p in range(first, end - 1)]
    return torch.log_softmax(torch.cat(rows), dim=-1)


def _window_loss(logp: torch.Tensor, targets: torch.Tensor, first: int, end: int, whose: str = "the") -> float:
    """The summed negative log-likelihood of a window's targets; an error, not a nan perplexity, when
    it is not finite (the weights are checked finite at load, so the computation overflowed)."""
    loss = -logp.gather(1, targets[:, None]).sum().item()
    if not math.isfinite(loss):
        raise EdgeMoEError(f"evaluate: {whose} loss of tokens {first}..{end - 1} is {loss} (the model "
                           f"computed non-finite log-probabilities: an overflow in its dtype?)")
    return loss


def evaluate(model: MoEModel, ids: torch.Tensor | list[int], context: int | None = None, stride: int | None = None,
             reference: MoEModel | None = None, on_progress: Callable[[int, int], None] | None = None,
             decode: bool = False) -> EvalResult:
    """Perplexity of `model` over ids (and agreement, KL against `reference`); on_progress(windows
    done, windows in all) after each window. decode: score token by token (_log_probs)."""
    ids = torch.as_tensor(ids, dtype=torch.long)
    if ids.numel() < 2:
        raise ValueError("evaluate: the text has fewer than 2 tokens")
    context = window_length(context, "context=", model.context_length) or default_context(model)
    stride = integer_at_least(stride, "stride=", 1) or max(1, context // 2)
    if stride > context:
        raise OptionError("stride=", stride, f"expected at most the window's {context} tokens")
    if reference is not None and reference.spec.vocab_size != model.spec.vocab_size:
        raise ValueError(f"reference vocab size {reference.spec.vocab_size} != model's {model.spec.vocab_size}")
    nll = ref_nll = kl = 0.0
    agree = count = 0
    spans = list(windows(ids.numel(), context, stride))
    for done, (begin, end, first) in enumerate(spans, 1):
        targets = ids[first:end]
        logp = _log_probs(model, ids, begin, end, first, decode)
        nll += _window_loss(logp, targets, first, end)
        count += targets.numel()
        if reference is not None:
            ref_logp = _log_probs(reference, ids, begin, end, first)
            ref_nll += _window_loss(ref_logp, targets, first, end, "the reference's")
            kl += (ref_logp.exp() * (ref_logp - logp)).sum().item()
            agree += (ref_logp.argmax(-1) == logp.argmax(-1)).sum().item()
        if on_progress:
            on_progress(done, len(spans))
    result = EvalResult(count, context, stride, math.exp(nll / count), nll / count)
    if reference is not None:
        result.top1_agreement = agree / count
        result.kl = kl / count
        result.reference_perplexity = math.exp(ref_nll / count)
    return result


def evaluate_text(model: MoEModel, text: str, **kwargs) -> EvalResult:
    if model.tokenizer is None:
        raise ValueError("evaluate: this model has no tokenizer")
    return evaluate(model, model.tokenizer.encode(text, add_special_tokens=False), **kwargs)
