"""edgemoe: run Mixture-of-Experts LLMs on machines too small to hold them.

    model = edgemoe.load(path)            # a Hugging Face MoE checkpoint directory, or a store:
    model = edgemoe.load(store, ram="25%", policy="expected-use")   # StoreOptions, model.close()
    model.logits(token_ids)               # float32 [T, vocab]
    model.generate("ROMEO:", max_new_tokens=50)
    model.tokenizer
"""

import os

from .errors import CheckpointError, EdgeMoEError, UnsupportedModelError

# torch's bfloat16 matrix products go through oneDNN, which keeps every product shape it has seen
# (1024 by default, a megabyte or so each): expert batches, whose row counts vary call after call (a
# prefill's, a budget search's), grew a search's process by 1.3 GB (docs/budget.md, "Cheaper
# passes"). A user's own setting is kept.
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "32")

__version__ = "0.1.0"


def __getattr__(name: str):
    """load and StoreOptions are imported on first use: importing the package (as `edgemoe --help`
    does) stays light, and torch and numba are loaded only by what computes."""
    if name in ("load", "StoreOptions"):
        from . import loader
        return getattr(loader, name)
    raise AttributeError(f"module 'edgemoe' has no attribute {name!r}")

__all__ = ["CheckpointError", "EdgeMoEError", "StoreOptions", "UnsupportedModelError", "load", "__version__"]
