"""Text that is not valid UTF-8, at every entry point: one line naming the source (flag, field, file)
and the byte offset of the first bad byte; exit status 2 on the command line; a chat goes on."""

import io
import subprocess
import sys

import pytest

import edgemoe
from edgemoe.bundled import bundled_model_path
from edgemoe.chat import chat_loop
from edgemoe.errors import TextError
from edgemoe.tokenizer import valid_text
from helpers import run_cli


@pytest.mark.parametrize("text, where", [
    (b"caf\xe9", "byte 3 (0xe9)"),                    # a Latin-1 byte
    ("caf\udce9", "byte 3 (0xe9)"),                   # the same, as Python hands over a command-line argument
    ("\u00e9t\u00e9\udcff!", "byte 5 (0xff)"),        # offsets count bytes (2 + 1 + 2), not characters
    ("ab\ud800cd", "byte 2 (a lone surrogate U+D800)"),   # a JSON string's "\ud800"
    (b"\xef\xbb\xbfok\xc3", "byte 5 (0xc3)"),         # a character cut short at the end
    (bytes(range(256)), "byte 128 (0x80)"),           # binary garbage
])
def test_the_first_bad_byte_is_named_by_offset_and_value(text, where):
    with pytest.raises(TextError) as info:
        valid_text(text, "prompt")
    assert str(info.value) == f"prompt: not valid UTF-8 at {where}"


def test_valid_text_passes_unchanged():
    assert valid_text("caf\u00e9 \U0001f600", "x") == "caf\u00e9 \U0001f600"
    assert valid_text("caf\u00e9".encode(), "x") == "caf\u00e9"


@pytest.mark.parametrize("args, flag", [(["run", "-p", b"caf\xe9"], "--prompt"),
                                        (["run", "-p", "ok", "--stop", b"caf\xe9"], "--stop"),
                                        (["chat", "--system", b"caf\xe9"], "--system")])
def test_an_argument_that_is_not_utf8_exits_2_with_one_line(tiny_model, args, flag):
    """The real command line: the bytes reach Python's argv as surrogate escapes."""
    command, *rest = args
    done = subprocess.run([sys.executable, "-m", "edgemoe", command, str(tiny_model("mixtral")), *rest],
                          capture_output=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.decode() == f"error: {flag}: not valid UTF-8 at byte 3 (0xe9)\n"


@pytest.mark.parametrize("command", [["eval", "{model}", "--text", "{text}"],
                                     ["trace", "{model}", "--text", "{text}", "-o", "{out}"],
                                     ["convert", "{model}", "-o", "{out}", "--calib", "{text}"]])
def test_a_text_file_that_is_not_utf8_is_named_with_the_offset(monkeypatch, capsys, tiny_model, tmp_path, command):
    text = tmp_path / "t.txt"
    text.write_bytes(b"To be, or not to be. " * 600 + b"\xff" + b" that is the question")
    values = {"model": tiny_model("mixtral"), "text": text, "out": tmp_path / "out"}
    code, err = run_cli(monkeypatch, capsys, *[part.format(**values) for part in command])
    assert code == 2 and err == f"error: {text}: not valid UTF-8 at byte 12600 (0xff)"
    assert not (tmp_path / "out").exists()


def test_the_python_api_refuses_such_text_by_name():
    model = edgemoe.load(bundled_model_path())
    with pytest.raises(TextError, match=r"^text: not valid UTF-8 at byte 3 \(0xe9\)$"):
        model.generate("caf\udce9", max_new_tokens=1)


def test_a_chat_line_that_is_not_utf8_is_refused_and_the_chat_goes_on():
    model = edgemoe.load(bundled_model_path())
    feed = iter(["caf\udce9", "Who art thou?"])

    def read_line():
        try:
            return next(feed)
        except StopIteration:
            raise EOFError from None

    out = io.StringIO()
    chat_loop(model, read_line, out, max_new_tokens=4, temperature=0.0)
    expected = model.generate(model.tokenizer.encode_chat([{"role": "user", "content": "Who art thou?"}]),
                              max_new_tokens=4, temperature=0.0)
    assert "> [input: not valid UTF-8 at byte 3 (0xe9); not sent]\n> " + expected + "\n> " in out.getvalue()


def test_the_chat_command_reads_a_bad_line_from_stdin_and_goes_on():
    done = subprocess.run([sys.executable, "-m", "edgemoe", "chat", "--temperature", "0", "-n", "4"],
                          input=b"caf\xe9\nWho art thou?\n/exit\n", capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr
    shown = done.stdout.decode()
    assert "[input: not valid UTF-8 at byte 3 (0xe9); not sent]\n> " in shown
    assert shown.count("> ") == 3 and "Traceback" not in done.stderr.decode()
