"""`edgemoe chat`: history through the chat template, /reset, /exit and end of input, Ctrl-C during an
answer stops only that answer; the command itself fed on stdin."""

import io
import signal
import subprocess
import sys

import pytest

import edgemoe
from edgemoe.bundled import bundled_model_path
from edgemoe.chat import chat_loop
from edgemoe.errors import EdgeMoEError

N = 8


@pytest.fixture(scope="module")
def model():
    return edgemoe.load(bundled_model_path())


def answer(model, messages):
    return model.generate(model.tokenizer.encode_chat(messages), max_new_tokens=N, temperature=0.0)


def lines(*items):
    feed = iter(items)

    def read_line():
        try:
            return next(feed)
        except StopIteration:
            raise EOFError from None
    return read_line


def test_history_goes_through_the_template_and_reset_clears_it(model):
    out = io.StringIO()
    chat_loop(model, lines("Who art thou?", "And whence?", "/reset", "And whence?", "/exit", "never read"), out,
              max_new_tokens=N, temperature=0.0)
    first = answer(model, [{"role": "user", "content": "Who art thou?"}])
    second = answer(model, [{"role": "user", "content": "Who art thou?"}, {"role": "assistant", "content": first},
                            {"role": "user", "content": "And whence?"}])
    fresh = answer(model, [{"role": "user", "content": "And whence?"}])
    text = out.getvalue()
    assert f"> {first}\n> {second}\n> [history cleared]\n> {fresh}\n> " in text
    assert second != fresh


class InterruptedOutput(io.StringIO):
    """Raises KeyboardInterrupt (as Ctrl-C would) at the second piece of the first answer."""

    def __init__(self):
        super().__init__()
        self.pieces = 0

    def write(self, text):
        if self.getvalue().count("> ") == 1:          # the first answer is being written
            self.pieces += 1
            if self.pieces == 2:
                raise KeyboardInterrupt
        return super().write(text)


def test_ctrl_c_stops_the_answer_keeps_what_was_shown_and_the_loop_goes_on(model):
    out = InterruptedOutput()
    chat_loop(model, lines("Who art thou?", "And whence?"), out, max_new_tokens=N, temperature=0.0)
    full = answer(model, [{"role": "user", "content": "Who art thou?"}])
    shown = out.getvalue().split("> ")[1].split(" [stopped]")[0]
    assert " [stopped]\n" in out.getvalue() and full.startswith(shown) and 0 < len(shown) < len(full)
    after = answer(model, [{"role": "user", "content": "Who art thou?"}, {"role": "assistant", "content": shown},
                           {"role": "user", "content": "And whence?"}])
    assert out.getvalue().endswith(f"> {after}\n> \n")         # then end of input


def test_old_exchanges_are_dropped_when_the_history_outgrows_the_context(model):
    out = io.StringIO()
    long = "To be, or not to be, that is the question. " * 7      # 80-odd tokens: three outgrow 256
    chat_loop(model, lines(long, long, long), out, max_new_tokens=N, temperature=0.0)
    user = {"role": "user", "content": long}
    first = answer(model, [user])
    second = answer(model, [user, {"role": "assistant", "content": first}, user])
    third = answer(model, [user, {"role": "assistant", "content": second}, user])    # the first exchange dropped
    assert f"> {first}\n> {second}\n> [oldest exchange dropped: the history outgrew the context]\n" \
           f"{third}\n> " in out.getvalue()


def test_a_tokenizer_without_chat_template_is_refused_by_name(model, monkeypatch):
    monkeypatch.setattr(model.tokenizer, "chat_template", None)
    with pytest.raises(EdgeMoEError, match="chat_template"):
        chat_loop(model, lines("hi"), io.StringIO())


def test_the_chat_command_on_stdin(model):
    done = subprocess.run([sys.executable, "-m", "edgemoe", "chat", "--temperature", "0", "-n", str(N)],
                          input="Who art thou?\n/exit\n", capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"> {answer(model, [{'role': 'user', 'content': 'Who art thou?'}])}\n> " in done.stdout


def test_the_chat_command_serves_the_context_asked_for_and_refuses_a_longer_one(model):
    whole = model.spec.max_position_embeddings
    short = subprocess.run([sys.executable, "-m", "edgemoe", "chat", "--context", "40"], input="/exit\n",
                           capture_output=True, text=True, timeout=120)
    assert short.returncode == 0 and "serving a context of 40 tokens (--context 40)" in short.stderr
    long = subprocess.run([sys.executable, "-m", "edgemoe", "chat", "--context", str(whole + 1)], input="/exit\n",
                          capture_output=True, text=True, timeout=120)
    assert long.returncode == 2 and f"--context {whole + 1}" in long.stderr and "longer than the model's" in long.stderr


def interrupted_chat() -> tuple[str, int, str]:
    """(everything shown, exit status, stderr) of a chat sent SIGINT once its answer shows its first
    character, then /exit."""
    chat = subprocess.Popen([sys.executable, "-m", "edgemoe", "chat", "-n", "200", "--temperature", "0"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        shown = ""
        while not shown.endswith("> "):
            shown += chat.stdout.read(1)
        chat.stdin.write("Who art thou?\n")
        chat.stdin.flush()
        answer_start = len(shown)
        while len(shown) == answer_start:           # the answer is streaming (up to 200 tokens)
            shown += chat.stdout.read(1)
        chat.send_signal(signal.SIGINT)
        rest, errors = chat.communicate("/exit\n", timeout=120)
    finally:
        chat.kill()
    return shown + rest, chat.returncode, errors


def test_sigint_during_an_answer_stops_it_and_the_command_goes_on():
    # The answer is written into a pipe ahead of this process's reads: on a loaded machine (a
    # fresh clone's suite in two workers) it can end before the signal arrives, and the chat then
    # goes on at its prompt. Up to three tries; the stop itself is tested in-process above
    # (test_ctrl_c_stops_the_answer_keeps_what_was_shown_and_the_loop_goes_on).
    for _ in range(3):
        shown, status, errors = interrupted_chat()
        assert status == 0, errors
        if shown.endswith(" [stopped]\n> "):
            return
        assert shown.endswith("\n> ") and "Traceback" not in errors
    pytest.skip("each of three answers ended before SIGINT reached the chat (a loaded machine)")
