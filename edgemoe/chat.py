"""`edgemoe chat`: an interactive loop over the tokenizer's chat template, answers streamed.

Lines read from `lines` are user messages; `/reset` clears the history, `/exit` (or end of input)
leaves. Ctrl-C during an answer stops that answer (what was shown stays in the history); Ctrl-C at
the prompt only reminds how to leave. When the history no longer fits the model's context with room
for an answer, the oldest exchanges are dropped.
"""

from __future__ import annotations

from typing import Callable, TextIO

from .errors import EdgeMoEError, TextError
from .generate import generate
from .model import MoEModel
from .tokenizer import valid_text

HELP = "commands: /reset clears the history, /exit (or Ctrl-D) leaves"


def chat_loop(model: MoEModel, read_line: Callable[[], str], out: TextIO, max_new_tokens: int = 200,
              system: str | None = None, **options) -> None:
    """Run the loop until /exit or end of input. `read_line` returns the next line without its newline
    and raises EOFError at the end (as `input` does); `options` are generate()'s sampling options."""
    tokenizer = model.tokenizer
    if tokenizer is None or not tokenizer.chat_template:
        raise EdgeMoEError(f"{model.name}: the tokenizer has no chat_template (tokenizer_config.json), so it "
                           f"cannot chat; use `edgemoe run` to continue plain text")
    context = model.context_length
    preamble = [{"role": "system", "content": system}] if system else []
    history: list[dict] = []
    out.write(f"{HELP}\n")
    while True:
        out.write("> ")
        out.flush()
        try:
            line = valid_text(read_line(), "input").strip()
        except TextError as e:   # one bad line costs that line, not the conversation
            out.write(f"[{e}; not sent]\n")
            continue
        except EOFError:
            out.write("\n")
            return
        except KeyboardInterrupt:
            out.write(f"\n{HELP}\n")
            continue
        if line == "/exit":
            return
        if line == "/reset":
            history = []
            out.write("[history cleared]\n")
            continue
        if not line or line.startswith("/"):
            if line:
                out.write(f"{HELP}\n")
            continue
        history.append({"role": "user", "content": line})
        prompt_ids = _fit(tokenizer, preamble, history, context, room=min(max_new_tokens, context // 2), out=out)
        if prompt_ids is None:
            history.pop()
            out.write(f"[that message alone fills the context of {context} tokens]\n")
            continue
        history.append({"role": "assistant", "content": _answer(model, prompt_ids, out,
                                                                min(max_new_tokens, context - len(prompt_ids)),
                                                                options)})


def _answer(model: MoEModel, prompt_ids: list[int], out: TextIO, max_new_tokens: int, options: dict) -> str:
    """Stream the answer to `out`; return the text shown (all of it, or up to Ctrl-C)."""
    pieces: list[str] = []

    def show(piece: str) -> None:
        pieces.append(piece)
        out.write(piece)
        out.flush()

    try:
        generate(model, prompt_ids, on_text=show, max_new_tokens=max_new_tokens, **options)
    except KeyboardInterrupt:
        out.write(" [stopped]")
    out.write("\n")
    return "".join(pieces)


def _fit(tokenizer, preamble: list[dict], history: list[dict], context: int, room: int, out: TextIO) -> list[int] | None:
    """Prompt ids of preamble + history, dropping the oldest exchanges (user and assistant together,
    so roles keep alternating) until `room` tokens are left for the answer. None if the last message
    alone leaves no room for one token."""
    while True:
        ids = tokenizer.encode_chat(preamble + history)
        if len(ids) + room <= context or len(history) == 1:
            return ids if len(ids) < context else None
        del history[:2]
        out.write("[oldest exchange dropped: the history outgrew the context]\n")
