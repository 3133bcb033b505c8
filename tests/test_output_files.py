"""Files the commands write (edgemoe.files): never over an input of the command, never over an existing
file without --force, and atomically, so that an interrupted write leaves the old file whole and no
temporary file behind. Each writer: trace -o, profile (STORE/profile.json), inspect --plot; and
convert into an existing empty directory."""

import json
import os
import shutil

import pytest

from edgemoe.convert import convert
from edgemoe.files import OutputError, atomic_write, refuse_overwrite
from edgemoe.scheduling.profile import TraceRecord, read_trace, write_trace
from edgemoe.store import read_manifest
from edgemoe.store.format import MANIFEST, PROFILE
from helpers import run_cli

TEXT = "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer. " * 4


@pytest.fixture(scope="module")
def checkpoint(tiny_model):
    return tiny_model("mixtral", max_position_embeddings=64)


@pytest.fixture(scope="module")
def profiled_store(checkpoint, tmp_path_factory):
    """A store whose convert profiled its routing (it holds a profile.json)."""
    out = tmp_path_factory.mktemp("writers") / "store"
    convert(checkpoint, out, bits=4, calib_text=TEXT)
    return out


@pytest.fixture
def store(profiled_store, tmp_path):
    """A private copy (the profile tests replace its profile.json)."""
    shutil.copytree(profiled_store, tmp_path / "store")
    return tmp_path / "store"


@pytest.fixture
def text(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text(TEXT)
    return path


def one_line_error(code, err, *phrases):
    assert code == 2 and err.count("\n") == 0 and err.startswith("error: "), err
    assert "Traceback" not in err and all(p in err for p in phrases), err


def leftovers(directory):
    """Temporary files atomic_write left behind."""
    return [p.name for p in directory.iterdir() if p.name.endswith(".tmp")]


# ---- the helper ---------------------------------------------------------------------------------
def test_atomic_write_replaces_the_file_whole(tmp_path):
    path = tmp_path / "out.txt"
    path.write_text("old")
    atomic_write(path, "new text")
    assert path.read_text() == "new text"
    atomic_write(path, b"\x00\x01")
    assert path.read_bytes() == b"\x00\x01"
    atomic_write(path, lambda f: f.write("from a callback"))
    assert path.read_text() == "from a callback" and leftovers(tmp_path) == []


@pytest.mark.parametrize("failure", [OSError("No space left on device"), KeyboardInterrupt()])
def test_an_interrupted_write_leaves_the_old_file_whole_and_no_temporary_file(tmp_path, failure):
    path = tmp_path / "out.txt"
    path.write_text("old contents")

    def write_half_then_fail(f):
        f.write("new con")
        f.flush()
        raise failure

    with pytest.raises(type(failure)):
        atomic_write(path, write_half_then_fail)
    assert path.read_text() == "old contents"
    assert leftovers(tmp_path) == []


def test_the_written_file_gets_the_modes_open_would_give_it(tmp_path):
    path = tmp_path / "out.txt"
    atomic_write(path, "x")
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask


def test_refuse_overwrite_never_an_input_even_forced(tmp_path, text):
    link = tmp_path / "link.txt"
    link.symlink_to(text)
    hard = tmp_path / "hard.txt"
    os.link(text, hard)
    for path in (text, link, hard):
        with pytest.raises(OutputError, match="is the input"):
            refuse_overwrite(path, [text], True, "--force")
    with pytest.raises(OutputError, match="contains the input"):
        refuse_overwrite(tmp_path, [text], True, "--force")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    with pytest.raises(OutputError, match="is a file of the input"):
        refuse_overwrite(tmp_path / "model" / "config.json", [tmp_path / "model"], True, "--force")
    refuse_overwrite(tmp_path / "model" / "new.jsonl", [tmp_path / "model"], False, "--force")   # loses nothing
    assert text.read_text() == TEXT


def test_refuse_overwrite_an_existing_file_only_when_forced(tmp_path):
    path = tmp_path / "calib.txt"
    path.write_text("someone's file")
    with pytest.raises(OutputError, match=r"calib.txt: already exists \(use force=True to replace it\)"):
        refuse_overwrite(path, [], False, "force=True")
    refuse_overwrite(path, [], True, "force=True")
    with pytest.raises(OutputError, match="is a directory"):
        refuse_overwrite(tmp_path, [], True, "--force")
    with pytest.raises(OutputError, match="no directory"):
        refuse_overwrite(tmp_path / "nowhere" / "t.jsonl", [], False, "--force")
    assert path.read_text() == "someone's file"


# ---- trace -o -----------------------------------------------------------------------------------
def test_trace_refuses_to_write_over_its_own_text(monkeypatch, capsys, store, text):
    code, err = run_cli(monkeypatch, capsys, "trace", str(store), "--text", str(text), "-o", str(text), "--force")
    one_line_error(code, err, str(text), "is the input")
    assert text.read_text() == TEXT


def test_trace_refuses_a_file_of_its_store(monkeypatch, capsys, store, text):
    manifest = (store / MANIFEST).read_bytes()
    code, err = run_cli(monkeypatch, capsys, "trace", str(store), "--text", str(text), "-o", str(store / MANIFEST),
                        "--force")
    one_line_error(code, err, "is a file of the input")
    assert (store / MANIFEST).read_bytes() == manifest


def test_trace_replaces_an_existing_file_only_with_force(monkeypatch, capsys, store, text, tmp_path):
    other = tmp_path / "calib.txt"
    other.write_text("an unrelated file")
    code, err = run_cli(monkeypatch, capsys, "trace", str(store), "--text", str(text), "-o", str(other))
    one_line_error(code, err, str(other), "already exists", "--force")
    assert other.read_text() == "an unrelated file"
    code, err = run_cli(monkeypatch, capsys, "trace", str(store), "--text", str(text), "-o", str(other), "--force")
    assert code == 0, err
    assert len(read_trace(other)) > 0 and leftovers(tmp_path) == []


def test_an_interrupted_trace_write_keeps_the_old_trace(tmp_path):
    path = tmp_path / "trace.jsonl"
    old = [TraceRecord(0, t, 0, [1, 2], [0.5, 0.5]) for t in range(4)]
    write_trace(path, old)
    before = path.read_bytes()

    def records():
        yield from old[:2]
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_trace(path, records())
    assert path.read_bytes() == before and leftovers(tmp_path) == []


# ---- profile (STORE/profile.json) ---------------------------------------------------------------
def test_profile_replaces_an_existing_profile_only_with_force(monkeypatch, capsys, store, text):
    before = (store / PROFILE).read_bytes()
    code, err = run_cli(monkeypatch, capsys, "profile", str(store), "--text", str(text))
    one_line_error(code, err, str(store / PROFILE), "already exists", "--force")
    assert (store / PROFILE).read_bytes() == before
    code, err = run_cli(monkeypatch, capsys, "profile", str(store), "--text", str(text), "--force", "--min-count", "1")
    assert code == 0, err
    assert json.loads((store / PROFILE).read_text())["routing"]["min_count"] == 1
    assert leftovers(store) == []


def test_profile_refuses_its_own_profile_as_the_input_trace(monkeypatch, capsys, store):
    before = (store / PROFILE).read_bytes()
    code, err = run_cli(monkeypatch, capsys, "profile", str(store), "--trace", str(store / PROFILE), "--force")
    one_line_error(code, err, "is the input")
    assert (store / PROFILE).read_bytes() == before


def test_an_interrupted_profile_write_keeps_the_old_profile(monkeypatch, store):
    from edgemoe.scheduling.profile import RoutingProfile
    from edgemoe.store import load_routing_profile, save_routing_profile

    before = (store / PROFILE).read_bytes()
    profile = load_routing_profile(store)

    def dump_half_then_fail(data, f):
        f.write(json.dumps(data)[:100])
        raise OSError("No space left on device")

    monkeypatch.setattr(json, "dump", dump_half_then_fail)
    with pytest.raises(OSError, match="No space"):
        save_routing_profile(store, profile)
    assert (store / PROFILE).read_bytes() == before and leftovers(store) == []
    assert isinstance(load_routing_profile(store), RoutingProfile)


# ---- inspect --plot -----------------------------------------------------------------------------
def test_inspect_plot_refuses_its_store_and_an_existing_file_and_replaces_with_force(monkeypatch, capsys, store,
                                                                                      tmp_path):
    pytest.importorskip("matplotlib")
    manifest = (store / MANIFEST).read_bytes()
    code, err = run_cli(monkeypatch, capsys, "inspect", str(store), "--plot", str(store / MANIFEST), "--force")
    one_line_error(code, err, "is a file of the input")
    assert (store / MANIFEST).read_bytes() == manifest
    png = tmp_path / "widths.png"
    png.write_text("an unrelated file")
    code, err = run_cli(monkeypatch, capsys, "inspect", str(store), "--plot", str(png))
    one_line_error(code, err, str(png), "already exists", "--force")
    assert png.read_text() == "an unrelated file"
    code, err = run_cli(monkeypatch, capsys, "inspect", str(store), "--plot", str(png), "--force")
    assert code == 0, err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and leftovers(tmp_path) == []


def test_an_interrupted_plot_keeps_the_old_file(monkeypatch, store, tmp_path):
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    from edgemoe.plots import plot_width_map
    from edgemoe.store import inspect_store

    png = tmp_path / "widths.png"
    png.write_bytes(b"the old plot")

    def save_half_then_fail(self, target, **kwargs):
        (open(target, "wb") if isinstance(target, (str, os.PathLike)) else target).write(b"\x89PNG")
        raise KeyboardInterrupt

    monkeypatch.setattr(Figure, "savefig", save_half_then_fail)
    with pytest.raises(KeyboardInterrupt):
        plot_width_map(inspect_store(store), png)
    assert png.read_bytes() == b"the old plot" and leftovers(tmp_path) == []


# ---- convert into an existing empty directory (a fresh mount point) ------------------------------
def test_convert_fills_an_existing_empty_directory_without_force(monkeypatch, capsys, checkpoint, tmp_path):
    import edgemoe

    out = tmp_path / "mnt"
    out.mkdir()
    inode = out.stat().st_ino
    code, err = run_cli(monkeypatch, capsys, "convert", str(checkpoint), "-o", str(out))
    assert code == 0, err
    assert out.stat().st_ino == inode                 # the same directory, filled (a mount point stays one)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mnt"]
    assert not any(p.name.startswith(".partial-") for p in out.iterdir())
    assert edgemoe.load(out).logits([1, 2, 3]).shape[0] == 3
    code, err = run_cli(monkeypatch, capsys, "convert", str(checkpoint), "-o", str(out))   # now a store
    one_line_error(code, err, "already exists", "--force")


def test_a_directory_holding_anything_is_not_a_destination(monkeypatch, capsys, checkpoint, tmp_path):
    out = tmp_path / "mnt"
    out.mkdir()
    (out / ".hidden").write_text("keep me")
    code, err = run_cli(monkeypatch, capsys, "convert", str(checkpoint), "-o", str(out), "--force")
    one_line_error(code, err, "not an edgemoe store")
    assert [p.name for p in out.iterdir()] == [".hidden"]


def test_a_failed_convert_into_an_empty_directory_leaves_it_empty(checkpoint, tmp_path):
    out = tmp_path / "mnt"
    out.mkdir()

    def fail(stage, done, total):
        if done == 3:
            raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        convert(checkpoint, out, progress=fail)
    assert list(out.iterdir()) == [] and [p.name for p in tmp_path.iterdir()] == ["mnt"]


def test_a_convert_interrupted_while_moving_its_files_in_leaves_the_directory_empty(monkeypatch, checkpoint,
                                                                                   tmp_path):
    from edgemoe.convert import writer
    from edgemoe.store import StoreError

    out = tmp_path / "mnt"
    out.mkdir()
    real_replace, calls = os.replace, []

    def replace_then_fail(source, target):
        calls.append(target)
        if len(calls) == 4:   # the manifest written beside its files, then two of them moved in
            raise KeyboardInterrupt
        real_replace(source, target)

    monkeypatch.setattr(writer.os, "replace", replace_then_fail)
    with pytest.raises(KeyboardInterrupt):
        convert(checkpoint, out)
    assert list(out.iterdir()) == []
    with pytest.raises(StoreError):
        read_manifest(out)


def test_a_killed_convert_into_an_empty_directory_is_cleaned_up_by_the_next(checkpoint, tmp_path):
    import subprocess
    import sys

    out = tmp_path / "mnt"
    out.mkdir()
    code = ("import os; from edgemoe.convert import convert; "
            f"convert({str(checkpoint)!r}, {str(out)!r}, progress=lambda s, d, t: d == 3 and os.kill(os.getpid(), 9))")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == -9
    left = list(out.iterdir())
    assert len(left) == 1 and left[0].name.startswith(".partial-") and not (out / MANIFEST).exists()
    convert(checkpoint, out)
    assert not any(p.name.startswith(".partial-") for p in out.iterdir()) and (out / MANIFEST).is_file()
