"""A hand-edited or damaged manifest is refused when the store is opened, with one line naming
manifest.json, the entry (layer and expert) and the field: never met mid-generation. The mutations are
generated from a real store's manifest: every field of an expert entry, of a fallback entry and the
top-level fields, deleted, of the wrong type, and out of range for what each field means."""

import json
import shutil

import pytest

from edgemoe.convert import convert
from edgemoe.store import StoreError, open_store
from edgemoe.store.format import MANIFEST
from helpers import REMOVED, mutated, run_cli



@pytest.fixture(scope="module")
def store(tiny_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("manifest") / "store"
    convert(tiny_model("mixtral"), out, bits=4, fallback_bits=2)
    return out


@pytest.fixture()
def scratch(store, tmp_path):
    copied = tmp_path / "store"
    shutil.copytree(store, copied)
    return copied


def _wrong_type(value):
    return 5 if isinstance(value, str) else "x"


def _out_of_range(field: str, value, entry: dict, sizes: dict) -> list:
    """Values of the right type that the field cannot hold, by what the field means."""
    if field == "layer":
        return [-1, 999]
    if field == "expert":
        return [-1, 10**6]
    if field == "bits":
        return [3, 16, 0]
    if field == "file":
        return ["nope.bin", "../manifest.json"]
    if field == "offset" and "tensors" in entry:          # the blob's place in its file
        return [value + 1, value + 4095, -4096, sizes[entry["file"]], 1 << 40]
    if field == "offset":                                  # an array's place in the blob
        return [value + 64, value + 1, -64]
    if field == "length":
        return [0, value + 64, value - 64]
    if field == "stored_length":
        return [0, value + 1]
    if field == "crc32":
        return [-1, 2**32]
    if field == "compression":
        return ["gzip"]
    if field == "group_size":
        return [0, 3, -8]
    if field == "dtype":
        return ["float16", "uint4"]
    if field == "shape":
        return [[1, 1], list(reversed(value)), [value[0]], [value[0], value[1], 1]]
    if field == "tensors":
        return [{}]
    return []


def _leaves(record: dict, prefix=()):
    """(path, value) of every field of a nested record, objects included."""
    for key, value in record.items():
        yield (*prefix, key), value
        if isinstance(value, dict):
            yield from _leaves(value, (*prefix, key))


def entry_mutations(manifest: dict, sizes: dict, listed_as: tuple):
    """(path from the manifest's root, new value or REMOVED, field the error must name) for every field of
    the second entry of `listed_as`."""
    entry = manifest[listed_as[0]] if len(listed_as) == 1 else manifest[listed_as[0]][listed_as[1]]
    entry = entry[1]
    root = (*listed_as, 1)
    for path, value in _leaves(entry):
        field = ".".join(path)
        yield (*root, *path), REMOVED, field
        yield (*root, *path), _wrong_type(value), field
        for bad in _out_of_range(path[-1], value, entry if len(path) == 1 else {}, sizes):
            yield (*root, *path), bad, field


def top_level_mutations(manifest: dict):
    first_offset = manifest["experts"][0]["offset"]
    return [
        (("version",), 2, "version"), (("version",), "1", "version"), (("version",), REMOVED, "version"),
        (("complete",), False, "incomplete"), (("complete",), REMOVED, "incomplete"),
        (("format",), REMOVED, "format"), (("spec",), REMOVED, "spec"), (("spec", "hidden_size"), REMOVED, "spec"),
        (("alignment",), 512, "alignment"), (("alignment",), "4096", "alignment"), (("alignment",), REMOVED, "alignment"),
        (("checksum",), "md5", "checksum"), (("checksum",), REMOVED, "checksum"),
        (("dense",), REMOVED, "dense"), (("dense", "file"), REMOVED, "dense.file"), (("dense", "file"), "../x", "dense.file"),
        (("dense", "file"), 5, "dense.file"), (("dense", "size"), -1, "dense.size"), (("dense", "size"), "x", "dense.size"),
        (("dense", "crc32"), -1, "dense.crc32"), (("dense", "crc32"), 2**32, "dense.crc32"),
        (("quantization",), REMOVED, "quantization"), (("quantization", "array_alignment"), 32, "array_alignment"),
        (("data_files",), "x", "data_files"), (("data_files",), REMOVED, "data_files"), (("data_files",), [], "file"),
        (("data_files", 0, "name"), REMOVED, "data_files[0].name"), (("data_files", 0, "name"), 5, "data_files[0].name"),
        (("data_files", 0, "name"), "../x", "data_files[0].name"), (("data_files", 0, "size"), -1, "data_files[0].size"),
        (("data_files", 0, "size"), "x", "data_files[0].size"), (("data_files", 0, "size"), 1, "the manifest says 1"),
        (("experts",), "x", "experts"), (("experts",), REMOVED, "experts"),
        (("experts", 1, "offset"), first_offset, "overlaps"),              # two blobs on one byte range
        (("experts", 1), manifest["experts"][0], "listed twice"),
        (("fallback", "bits"), 3, "fallback.bits"), (("fallback", "bits"), 8, "fallback.bits"),
        (("fallback", "experts"), "x", "fallback.experts"),
        (("fallback", "experts", 1, "bits"), 4, "bits: 4, expected 2"),    # a copy as wide as its expert
        (("fallback", "experts"), manifest["fallback"]["experts"][1:], "no 2-bit copy"),
    ]


def _entry_label(manifest: dict, path: tuple) -> str | None:
    """'experts[1] (layer L expert E)' for a mutation of a field inside the second entry of a list."""
    for listed in (("experts",), ("fallback", "experts")):
        if path[:len(listed)] == listed and len(path) > len(listed) + 1 and path[len(listed)] == 1:
            entry = manifest[listed[0]][1] if len(listed) == 1 else manifest["fallback"]["experts"][1]
            label = f"{'.'.join(listed)}[1]"
            if path[len(listed) + 1] in ("layer", "expert"):   # named as written: the mutated value
                return label
            return f"{label} (layer {entry['layer']} expert {entry['expert']})"
    return None


def _open_error(store, monkeypatch, capsys) -> str:
    """The store opened through the library and through `edgemoe inspect`: both must refuse it, with
    the same one line. Returns it ("" when it opened)."""
    try:
        open_store(store).close()
    except StoreError as e:
        message = str(e)
    else:
        return ""
    code, err = run_cli(monkeypatch, capsys, "inspect", str(store))
    assert code == 2 and err == f"error: {message}", err
    return message


def test_the_unmodified_store_opens(store, monkeypatch, capsys):
    assert _open_error(store, monkeypatch, capsys) == ""
    code, _ = run_cli(monkeypatch, capsys, "inspect", str(store))
    assert code == 0


def test_every_field_of_every_kind_of_entry_mutated_is_refused_naming_it(scratch, monkeypatch, capsys):
    original = json.loads((scratch / MANIFEST).read_text())
    sizes = {f["name"]: f["size"] for f in original["data_files"]}
    cases = [*entry_mutations(original, sizes, ("experts",)),
             *entry_mutations(original, sizes, ("fallback", "experts")),
             *top_level_mutations(original)]
    assert len(cases) > 200
    failures = []
    for path, value, field in cases:
        (scratch / MANIFEST).write_text(json.dumps(mutated(original, path, value)))
        message = _open_error(scratch, monkeypatch, capsys)
        names = [field] + ([label] if (label := _entry_label(original, path)) else [])
        shown = "REMOVED" if value is REMOVED else repr(value)
        if not message or MANIFEST not in message or any(name not in message for name in names):
            failures.append(f"{'.'.join(map(str, path))} = {shown}: {message or 'opened'} (want {names})")
    assert not failures, f"{len(failures)} of {len(cases)} mutations:\n" + "\n".join(failures)
