"""edgemoe: run Mixture-of-Experts LLMs on machines too small to hold them.

    model = edgemoe.load(path)            # a Hugging Face MoE checkpoint directory, or a store:
    model = edgemoe.load(store, ram="25%", policy="expected-use")   # StoreOptions, model.close()
    model.logits(token_ids)               # float32 [T, vocab]
    model.generate("ROMEO:", max_new_tokens=50)
    model.tokenizer
"""

from .errors import CheckpointError, EdgeMoEError, UnsupportedModelError

__version__ = "0.1.0"


def __getattr__(name: str):
    """load and StoreOptions are imported on first use: importing the package (as `edgemoe --help`
    does) stays light, and torch and numba are loaded only by what computes."""
    if name in ("load", "StoreOptions"):
        from . import loader
        return getattr(loader, name)
    raise AttributeError(f"module 'edgemoe' has no attribute {name!r}")

__all__ = ["CheckpointError", "EdgeMoEError", "StoreOptions", "UnsupportedModelError", "load", "__version__"]
