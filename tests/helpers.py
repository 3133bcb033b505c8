"""Helpers shared by several test files (tests/ is on pytest's pythonpath: `from helpers import ...`)."""

import sys

import numpy as np
import pytest
import torch

from edgemoe.cli import main
from edgemoe.quant import get_format


REMOVED = object()   # a mutation that deletes the entry (mutated)


def mutated(document, path: tuple, value):
    """A deep copy of nested dicts and lists with the entry at `path` set to `value`, or deleted
    when `value` is REMOVED (generated bad-input tables: configs, manifests)."""
    import copy

    changed = copy.deepcopy(document)
    *parents, last = path
    target = changed
    for key in parents:
        target = target[key]
    if value is REMOVED:
        del target[last]
    else:
        target[last] = value
    return changed


def weights(rows, cols, seed=0):
    """A weight matrix like a trained one's: Gaussian with 1% outliers 20x larger."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * 0.05
    return torch.where(torch.rand(rows, cols, generator=g) < 0.01, w * 20, w)


def acts(tokens, cols, seed=1):
    return np.random.default_rng(seed).standard_normal((tokens, cols), dtype=np.float32)


def code_magnitude(qt):
    """M [R, C] = scale * (code + |zero|), the size of the terms a kernel adds up."""
    codes = get_format(qt.bits).unpack(torch.tensor(qt.packed), qt.group).double()  # [R, NG, G]
    mag = (codes + torch.tensor(np.abs(qt.zero)).double()[..., None]) * torch.tensor(qt.scale).double()[..., None]
    return mag.reshape(qt.shape[0], -1)[:, : qt.shape[1]].numpy()


def run_cli(monkeypatch, capsys, *args):
    """Run `edgemoe ARGS` in-process; (exit status, stderr stripped). The command must exit."""
    monkeypatch.setattr(sys, "argv", ["edgemoe", *args])
    capsys.readouterr()  # drop what fixtures printed
    with pytest.raises(SystemExit) as exit_info:
        main()
    return exit_info.value.code, capsys.readouterr().err.strip()


def decode(model, ids):
    """The logits of feeding `ids` one token per step through one cache: [len(ids), V]."""
    cache = model.new_cache()
    return torch.cat([model.logits([t], cache) for t in ids])


def decode_all_resident(store, ids, **options):
    """(logits of decode, the model) with every expert of `store` resident before the first token."""
    import edgemoe

    model = edgemoe.load(store, torch.float32, preload="none", **options)
    for entry in model.store.experts():
        model.store.get(*entry.key)
    return decode(model, ids), model
