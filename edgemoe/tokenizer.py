"""tokenizer.json (via `tokenizers`) plus tokenizer_config.json: special tokens and the chat template.

Special tokens are added as tokenizer.json's post-processor says (as transformers' fast tokenizers
do). Streaming decode holds back text that ends in an incomplete UTF-8 sequence, since a byte-level
BPE token can end in the middle of a character.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer

from .checkpoint import read_json
from .errors import CheckpointError, TextError


def _token_text(value) -> str | None:
    """A special token from tokenizer_config.json: a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def valid_text(text: str | bytes, source: str) -> str:
    """`text` as a str (bytes decoded as UTF-8), or a TextError naming `source` and the byte offset of
    the first bad byte. Every entry point that takes text calls it with its own source (the flag, the
    request field, the file), and Tokenizer.encode calls it for the Python API."""
    try:
        if isinstance(text, bytes):
            return text.decode("utf-8")
        text.encode("utf-8")   # a surrogate is not a character: the tokenizer could not take it
        return text
    except UnicodeError as e:
        raise TextError(f"{source}: not valid UTF-8 at byte {_bad_byte(text, e.start)}") from None


def _bad_byte(text: str | bytes, index: int) -> str:
    """'3 (0xe9)': where the bad byte (bytes) or surrogate (str) at `index` is, in bytes, and what it is."""
    if isinstance(text, bytes):
        return f"{index} (0x{text[index]:02x})"
    code = ord(text[index])
    # Python hands a command-line argument's (or a surrogateescape stream's) bytes that are not UTF-8 over
    # as U+DC80..U+DCFF; any other surrogate came as such (a JSON string's "\ud800").
    what = f"0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"a lone surrogate U+{code:04X}"
    return f"{len(text[:index].encode('utf-8'))} ({what})"


class Tokenizer:
    def __init__(self, directory: str | Path):
        directory = Path(directory)
        path = directory / "tokenizer.json"
        if not path.exists():
            raise CheckpointError(f"{path}: file not found (edgemoe needs a tokenizer.json)")
        try:
            self._tok = _HFTokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception on malformed files
            raise CheckpointError(f"{path}: cannot be read by tokenizers ({e})") from None
        config_path = directory / "tokenizer_config.json"
        self.config = read_json(config_path) if config_path.exists() else {}
        self.bos_token = _token_text(self.config.get("bos_token"))
        self.eos_token = _token_text(self.config.get("eos_token"))
        self.chat_template = self.config.get("chat_template")

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def difference(self, other: "Tokenizer") -> str | None:
        """What makes `other` encode or decode differently from this tokenizer, or None if nothing:
        the vocabulary first, then the rest of tokenizer.json (normalizer, pre-tokenizer, merges)."""
        mine, theirs = self._tok.get_vocab(with_added_tokens=True), other._tok.get_vocab(with_added_tokens=True)
        if mine != theirs:
            differing = sorted(set(mine.items()) ^ set(theirs.items()), key=lambda item: item[1])
            return (f"vocabularies differ ({len(mine)} and {len(theirs)} tokens; first difference: "
                    f"{differing[0][0]!r} -> {differing[0][1]})")
        if self._tok.to_str() != other._tok.to_str():
            return "same vocabulary, but tokenizer.json differs (normalizer, pre-tokenizer, merges or decoder)"
        return None

    def token_id(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    @property
    def eos_token_id(self) -> int | None:
        return self.token_id(self.eos_token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(valid_text(text, "text"), add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise CheckpointError("tokenizer_config.json: no chat_template, so --chat cannot be used")
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise CheckpointError(f"chat template: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        return env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "")

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the rendered chat template. The template writes the special tokens it wants
        (bos_token...), so none are added again (as transformers' apply_chat_template(tokenize=True))."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt), add_special_tokens=False)


class StreamDecoder:
    """Turns generated ids into text pieces as they come, never splitting a character.

    Each push decodes only the ids since the last emitted piece, with the few ids before them as
    context (a byte-level BPE token's text can depend on its neighbour), so a long generation costs
    linear time, not quadratic."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0   # ids[prefix:read] decode to text already returned (the context)
        self.read = 0     # ids before this index have been returned as text

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        done = self.tokenizer.decode(self.ids[self.prefix:self.read])
        text = self.tokenizer.decode(self.ids[self.prefix:])
        if len(text) <= len(done) or (text.endswith("\ufffd") and not final):
            return ""  # nothing new, or an incomplete UTF-8 sequence: wait for the next token
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(done):]
