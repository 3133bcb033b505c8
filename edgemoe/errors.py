"""Domain errors. Each names the file, tensor or option at fault, in one line."""


def option_message(option: str, value, expected: str) -> str:
    """'--ram 'lots': expected ...' on the command line, 'ram='lots': expected ...' from Python."""
    sep = "" if option.endswith("=") else " "
    return f"{option}{sep}{value!r}: {expected}"


class EdgeMoEError(ValueError):
    """Base class of every error caused by bad input (a file, a tensor, an option)."""


class CheckpointError(EdgeMoEError):
    """A Hugging Face checkpoint directory that cannot be loaded as it is."""


class UnsupportedModelError(CheckpointError):
    """A model_type (architecture) that edgemoe has no model file for."""


class TextError(EdgeMoEError):
    """Text that is not valid UTF-8: a prompt, a request's field, a chat line or a text file."""


class ContextLengthError(EdgeMoEError):
    """A prompt or window longer than the model's context (max_position_embeddings)."""


class DraftError(EdgeMoEError):
    """A speculative-decoding draft that cannot propose tokens for the target (another tokenizer)."""
