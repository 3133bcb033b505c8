"""YaRN rotary scaling as DeepSeek-V2/V3 configure it (rope_scaling / rope_parameters of type "yarn").

Rotary frequencies: each of the R/2 frequencies is blended between theta's own (extrapolation, for
the fast-turning dims) and theta's divided by `factor` (interpolation, for the slow ones), with a
linear ramp between the dims that turn beta_fast and beta_slow times over the original context.
cos and sin are multiplied by an attention factor (mscale(factor, mscale) / mscale(factor,
mscale_all_dim)), and DeepSeek also multiplies the softmax scale by mscale(factor, mscale_all_dim)^2.

Shapes: R rotary dims per head.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from ..spec import config_bool, config_float, config_int
from .common import Attention, Rotary, register


@register
@dataclass(frozen=True, kw_only=True)
class Yarn(Rotary):
    """Rotary frequencies blended as above, cos and sin times the attention factor."""

    kind = "yarn"
    rope_inv_freq: tuple[float, ...]   # [R/2]
    rope_attention_factor: float

    def __post_init__(self):
        object.__setattr__(self, "rope_inv_freq", tuple(self.rope_inv_freq))   # a manifest's list

    def frequencies(self, positions):
        return self.rope_inv_freq, self.rope_attention_factor


def mscale(factor: float, scale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * scale * math.log(factor) + 1.0


def _correction_dim(rotations: float, dim: int, base: float, context: int) -> float:
    """The (fractional) dim index whose frequency turns `rotations` times over `context` positions."""
    return dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(base))


def yarn_inv_freq(dim: int, base: float, factor: float, context: int, beta_fast: float, beta_slow: float,
                  truncate: bool) -> torch.Tensor:
    """The scaled inverse frequencies [R/2], float32."""
    low, high = _correction_dim(beta_fast, dim, base, context), _correction_dim(beta_slow, dim, base, context)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001   # a step, not a division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolated = 1 - ramp     # share of theta's own frequency
    return (1.0 / (factor * freqs)) * (1 - extrapolated) + (1.0 / freqs) * extrapolated


def yarn_fields(config: dict, params: dict, rope_dim: int, attention: Attention, key_dim: int,
                base: float) -> dict:
    """ModelSpec fields of a "yarn" config: its rotary part, and `attention` with its softmax scale
    (for queries and keys of key_dim dims)."""
    where = params["field"]
    context = (config_int(config, "original_max_position_embeddings", default=None)
               or config_int(params, "original_max_position_embeddings", default=None, section=where)
               or config_int(config, "max_position_embeddings"))
    factor = (config_float(params, "factor", default=None, above=0, section=where)
              or config_int(config, "max_position_embeddings") / context)
    beta_fast = config_float(params, "beta_fast", default=32, above=0, section=where)
    beta_slow = config_float(params, "beta_slow", default=1, above=0, section=where)
    truncate = config_bool(params, "truncate", default=True, section=where)
    inv_freq = yarn_inv_freq(rope_dim, base, factor, context, beta_fast, beta_slow, truncate)
    scale = config_float(params, "mscale", default=None, minimum=0, section=where)
    scale_all = config_float(params, "mscale_all_dim", default=None, minimum=0, section=where)
    attention_factor = config_float(params, "attention_factor", default=None, above=0, section=where)
    if attention_factor is None:
        attention_factor = mscale(factor, scale) / mscale(factor, scale_all) if scale and scale_all else mscale(factor)
    softmax_scale = key_dim ** -0.5
    if scale_all:
        softmax_scale *= mscale(factor, scale_all) ** 2
    rotary = Yarn(rope_theta=base, rope_inv_freq=tuple(inv_freq.tolist()), rope_attention_factor=float(attention_factor))
    return dict(rotary=rotary, attention=replace(attention, attention_scale=softmax_scale))
