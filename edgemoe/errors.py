"""Domain errors. Each names the file, tensor or option at fault, in one line."""


class EdgeMoEError(ValueError):
    """Base class of every error caused by bad input (a file, a tensor, an option)."""


class CheckpointError(EdgeMoEError):
    """A Hugging Face checkpoint directory that cannot be loaded as it is."""


class UnsupportedModelError(CheckpointError):
    """A model_type (architecture) that edgemoe has no model file for."""


class ContextLengthError(EdgeMoEError):
    """A prompt or window longer than the model's context (max_position_embeddings)."""
