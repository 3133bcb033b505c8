"""edgemoe: run Mixture-of-Experts LLMs on machines too small to hold them.

    model = edgemoe.load(path)            # a Hugging Face MoE checkpoint directory
    model.logits(token_ids)               # float32 [T, vocab]
    model.generate("ROMEO:", max_new_tokens=50)
    model.tokenizer
"""

from .errors import CheckpointError, EdgeMoEError, UnsupportedModelError
from .loader import load

__version__ = "0.1.0"

__all__ = ["CheckpointError", "EdgeMoEError", "UnsupportedModelError", "load", "__version__"]
