"""edgemoe: run Mixture-of-Experts LLMs on machines too small to hold them.

    model = edgemoe.load(path)            # a Hugging Face MoE checkpoint directory, or a store:
    model = edgemoe.load(store, ram="25%", policy="expected-use")   # StoreOptions, model.close()
    model.logits(token_ids)               # float32 [T, vocab]
    model.generate("ROMEO:", max_new_tokens=50)
    model.tokenizer
"""

from .errors import CheckpointError, EdgeMoEError, UnsupportedModelError
from .loader import StoreOptions, load

__version__ = "0.1.0"

__all__ = ["CheckpointError", "EdgeMoEError", "StoreOptions", "UnsupportedModelError", "load", "__version__"]
