"""Malformed config.json fields and safetensors headers, generated rather than picked: every field of
every architecture's tiny config, and every entry key of a header, mutated to each wrong kind. Each
case ends in a CheckpointError of one line naming the file and the field (or tensor), or, where the
value is acceptable, in a parsed model; never in another exception. Parsing only: no model is built."""

import json
import re
import shutil
import struct

import pytest
import torch
from safetensors.torch import save_file

from edgemoe.checkpoint import Checkpoint, read_safetensors_header
from edgemoe.errors import CheckpointError
from edgemoe.models import ARCHITECTURES, architecture, parse_spec

from helpers import REMOVED, mutated


def config_fields(config: dict, section: tuple[str, ...] = ()):
    """(path of keys, value) of every field of a config, inside objects too (rope_parameters)."""
    for key, value in config.items():
        yield section + (key,), value
        if isinstance(value, dict):
            yield from config_fields(value, section + (key,))




def wrong_kinds(value) -> dict:
    """Values of other kinds than `value`'s (and, for a number, out of any size's range)."""
    if isinstance(value, bool):
        return {"string": str(value).lower(), "integer": int(value), "list": [value]}
    if isinstance(value, (int, float)):
        wrong = {"string": str(value), "list": [value], "bool": True, "negative": -abs(value) - 1}
        return {**wrong, "fraction": value + 0.5, "integral float": float(value)} if isinstance(value, int) else wrong
    if isinstance(value, str):
        return {"number": 5, "list": [value], "object": {"value": value}}
    if isinstance(value, list):
        return {"number": 5, "string": "x", "list of objects": [{}]}
    if isinstance(value, dict):
        return {"number": 5, "string": "x", "list": [value]}
    return {}


def mutations(value):
    """(kind, new value, what may happen): "refused" = an error, or a spec equal to the original one
    (a field the architecture does not read); "either" = an error or a parsed spec; "accepted" = parsed."""
    cases = [(kind, new, "refused") for kind, new in wrong_kinds(value).items()]
    cases += [("null", None, "either"), ("removed", REMOVED, "either")]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        cases.append(("zero", 0, "either"))
    if isinstance(value, float):   # a float field given as an integer is a number like any other
        cases.append(("integer", max(1, round(value)), "accepted"))
    return cases


def outcome(config: dict):
    """The parsed spec (tensor names mapped too), or the CheckpointError raised."""
    try:
        spec = parse_spec(config)
        architecture(spec.model_type).tensor_names(spec)
        return spec
    except CheckpointError as e:
        return e


def problem(case: str, field: str, expect: str, result, original) -> str | None:
    """What is wrong with one case's result, or None."""
    if isinstance(result, CheckpointError):
        message = str(result)
        if expect == "accepted":
            return f"{case}: refused ({message})"
        if "config.json" not in message or field not in message or "\n" in message:
            return f"{case}: the error does not name config.json and {field}: {message}"
        return None
    if expect == "refused" and result != original:
        return f"{case}: accepted, and the model changed"
    return None


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_every_config_field_of_a_wrong_kind_is_refused_by_name(tiny_model, arch):
    config = json.loads((tiny_model(arch) / "config.json").read_text())
    original = parse_spec(config)
    problems, cases = [], 0
    for path, value in config_fields(config):
        for kind, new, expect in mutations(value):
            case = f"{'.'.join(path)}={'(removed)' if new is REMOVED else repr(new)} ({kind})"
            try:
                result = outcome(mutated(config, path, new))
            except Exception as e:   # anything but the project's error is a traceback for the user
                problems.append(f"{case}: {type(e).__name__}: {e}")
                continue
            problems.append(problem(case, path[-1], expect, result, original))
            cases += 1
    assert [p for p in problems if p] == []
    assert cases > 200


def test_a_read_field_of_a_wrong_kind_is_refused_not_ignored(tiny_model):
    """The table above lets an unread field pass; these fields are read, so each mutation is refused."""
    config = json.loads((tiny_model("mixtral") / "config.json").read_text())
    for field, value in [("hidden_size", "64"), ("num_local_experts", 4.0), ("intermediate_size", -96),
                         ("num_hidden_layers", [2]), ("vocab_size", True), ("rms_norm_eps", "1e-6"),
                         ("num_experts_per_tok", 0), ("rms_norm_eps", 0)]:
        with pytest.raises(CheckpointError, match="^" + re.escape(f"config.json: {field}={value!r}: expected ")):
            parse_spec({**config, field: value})
    assert parse_spec({**config, "rms_norm_eps": 1}).rms_norm_eps == 1.0


# Safetensors headers: a small file of three tensors of the same byte length (so that moving one onto
# another keeps its length right and only the overlap is wrong).
TENSORS = ("first", "middle", "last")


@pytest.fixture
def header_file(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file({name: torch.full((2, 4), float(i)) for i, name in enumerate(TENSORS)}, path)
    return path


def read_header(path):
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + length]), raw[8 + length:]


def write_header(path, header, data):
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def entry_mutations(header: dict, name: str, data_size: int):
    """(kind, new entry) for one tensor's entry."""
    entry = header[name]
    begin, end = entry["data_offsets"]
    other = header[TENSORS[(TENSORS.index(name) + 1) % len(TENSORS)]]["data_offsets"]
    for key in entry:
        yield f"no {key}", {k: v for k, v in entry.items() if k != key}
    changes = {"dtype unknown": ("dtype", "F33"), "dtype not a string": ("dtype", 4),
               "dtype a list": ("dtype", ["F32"]),
               "shape not a list": ("shape", 8), "shape of strings": ("shape", ["2", "4"]),
               "shape negative": ("shape", [-2, -4]), "shape of floats": ("shape", [2.0, 4.0]),
               "shape too large": ("shape", [3, 4]), "shape too small": ("shape", [2]),
               "offsets reversed": ("data_offsets", [end, begin]),
               "offsets past the file": ("data_offsets", [data_size, data_size + end - begin]),
               "offsets overlapping another": ("data_offsets", other),
               "offsets half over another": ("data_offsets", [begin + 16, end + 16] if end < data_size else
                                             [begin - 16, end - 16]),
               "offsets negative": ("data_offsets", [-8, end - begin - 8]),
               "offsets not a pair": ("data_offsets", [begin]),
               "offsets of strings": ("data_offsets", [str(begin), str(end)]),
               "offsets not a list": ("data_offsets", begin)}
    for kind, (key, value) in changes.items():
        yield kind, {**entry, key: value}
    yield "entry not an object", "F32"


@pytest.mark.parametrize("name", TENSORS)
def test_every_header_entry_mutation_is_refused_naming_file_and_tensor(header_file, name):
    header, data = read_header(header_file)
    assert set(read_safetensors_header(header_file)) == set(TENSORS)
    problems, cases = [], list(entry_mutations(header, name, len(data)))
    for kind, entry in cases:
        write_header(header_file, {**header, name: entry}, data)
        try:
            read_safetensors_header(header_file)
            problems.append(f"{kind}: accepted")
        except CheckpointError as e:
            message = str(e)
            if str(header_file) not in message or repr(name) not in message or "\n" in message:
                problems.append(f"{kind}: does not name the file and {name!r}: {message}")
        except Exception as e:
            problems.append(f"{kind}: {type(e).__name__}: {e}")
    assert problems == []
    assert len(cases) > 15


def test_a_header_that_is_not_an_object_is_refused(header_file):
    _, data = read_header(header_file)
    write_header(header_file, [1, 2], data)
    with pytest.raises(CheckpointError, match="model.safetensors: corrupt safetensors header"):
        read_safetensors_header(header_file)


@pytest.mark.parametrize("file", [5, ["model-00001-of-00002.safetensors"], {"a": 1}, None])
def test_an_index_whose_weight_map_names_no_file_is_refused(tiny_model, tmp_path, file):
    path = tmp_path / "model"
    shutil.copytree(tiny_model("mixtral", shards=2), path)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"][next(iter(index["weight_map"]))] = file
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"model\.safetensors\.index\.json: no 'weight_map' of tensor names"):
        Checkpoint(path)
