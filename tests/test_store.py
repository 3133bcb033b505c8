"""The store: format round trip against a plain-torch reference, atomic convert, corruption detected,
tier budgets and policies, background loader, and greedy output independent of all of them."""

import json
import os
import shutil
import subprocess
import sys
import threading

import pytest
import torch

import edgemoe
from edgemoe.experts import DenseExpert, InMemoryExperts
from edgemoe.files import OutputError
from edgemoe.generate import GenerationOptions, generate_batch
from edgemoe.quant import dequantize_reference, quantize
from edgemoe.store import StoreError, inspect_store, open_store, read_manifest
from edgemoe.convert import convert
from edgemoe.store.format import ALIGNMENT, MANIFEST
from helpers import decode


@pytest.fixture(scope="module")
def checkpoint(tiny_model):
    return tiny_model("qwen2_moe", num_hidden_layers=3, num_experts=6, mlp_only_layers=[1])


@pytest.fixture(scope="module")
def store(checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("stores") / "q4"
    convert(checkpoint, out, bits=4)
    return out


def dequantized_reference(checkpoint, widths):
    """The checkpoint's model with each expert replaced by quantize -> dequantize_reference (plain torch)."""
    model = edgemoe.load(checkpoint)
    experts = {key: DenseExpert(**{role: dequantize_reference(quantize(e.weights[role], widths(key)))
                                   for role in ("gate", "up", "down")}, activation=e.activation)
               for key, e in model.experts.experts.items()}
    model.experts = InMemoryExperts(experts)
    return model


def tokens(model, text="To be, or not to be, that is the question"):
    return torch.tensor(model.tokenizer.encode(text))


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_store_logits_match_plain_torch_dequantized_model(checkpoint, tmp_path, bits):
    convert(checkpoint, tmp_path / "s", bits=bits)
    # float experts: the integer path (which "auto" may pick) rounds activations to int8, its own
    # tests bound that (tests/test_int_kernels.py, tests/test_latency.py)
    model = edgemoe.load(tmp_path / "s", compute="fused-float")
    reference = dequantized_reference(checkpoint, lambda key: bits)
    ids = tokens(model)
    assert (model.logits(ids) - reference.logits(ids)).abs().max() <= 1e-4


def test_per_expert_widths_and_compression(checkpoint, tmp_path):
    spec = edgemoe.load(checkpoint).spec
    widths = {str(l): [(2, 4, 8)[(l + e) % 3] for e in range(spec.num_experts)] for l in spec.moe_layer_ids}
    (tmp_path / "w.json").write_text(json.dumps({"widths": widths}))
    from edgemoe.convert import read_widths
    width_map = read_widths(tmp_path / "w.json", spec)
    convert(checkpoint, tmp_path / "mixed", widths=width_map, compress="zstd")
    manifest = read_manifest(tmp_path / "mixed")
    assert all(e.bits == width_map[e.key] and e.compression == "zstd" for e in manifest.experts.values())
    assert all(e.offset % ALIGNMENT == 0 for e in manifest.experts.values())
    model = edgemoe.load(tmp_path / "mixed", compute="fused-float")
    reference = dequantized_reference(checkpoint, lambda key: width_map[key])
    assert (model.logits(tokens(model)) - reference.logits(tokens(model))).abs().max() <= 1e-4
    assert inspect_store(tmp_path / "mixed")["widths"] == {k: v for k, v in widths.items()}


def test_a_layers_requested_bytes_are_its_experts_blob_lengths_at_mixed_and_one_width(checkpoint, tmp_path):
    """LayerLengths, which served_resident sums a step's requested bytes with: per layer, the chosen
    experts' blob lengths, whether the layer's widths differ (2/4/8 by expert) or not (one layer at 4)."""
    from edgemoe.store.tiers import LayerLengths

    spec = edgemoe.load(checkpoint).spec
    uniform = spec.moe_layer_ids[0]
    widths = {(l, e): 4 if l == uniform else (2, 4, 8)[(l + e) % 3]
              for l in spec.moe_layer_ids for e in range(spec.num_experts)}
    convert(checkpoint, tmp_path / "mixed", widths=widths)
    manifest = read_manifest(tmp_path / "mixed")
    lengths = LayerLengths(manifest)
    assert lengths.same[uniform] is not None and lengths.same[spec.moe_layer_ids[1]] is None
    for layer in spec.moe_layer_ids:
        for chosen in ([0], [1, 2], list(range(spec.num_experts))):
            assert lengths.of(layer, chosen) == sum(manifest.experts[(layer, e)].length for e in chosen)


def test_bad_width_file_names_the_file_and_layer(checkpoint, tmp_path):
    (tmp_path / "w.json").write_text(json.dumps({"widths": {"0": [4, 3]}}))
    from edgemoe.convert import read_widths
    with pytest.raises(StoreError, match=r"w\.json: layer 0 needs a list of 6 widths"):
        read_widths(tmp_path / "w.json", edgemoe.load(checkpoint).spec)


def greedy(model, n=12):
    prompts = [model.tokenizer.encode("To be, or not"), model.tokenizer.encode("All the world")]
    return generate_batch(model, prompts, GenerationOptions(max_new_tokens=n, stop_token_ids=[]))


def test_greedy_output_is_the_same_whatever_the_budgets_and_policies(store, vram_device):
    """RAM capacities and policies never change results. An expert in VRAM is dequantized and multiplied
    in float32, so runs with a VRAM tier are held to the float kernels' results (docs/architecture.md:
    they differ by summation order only; against the default integer path they differ by the int8
    rounding of activations, and greedy text may part at a near-tie, as it once did here)."""
    entry_bytes = max(e.length for e in read_manifest(store).experts.values())
    expected = greedy(edgemoe.load(store))
    expected_float = greedy(edgemoe.load(store, compute="fused-float"))
    settings = [dict(ram=0), dict(ram=entry_bytes), dict(ram=3 * entry_bytes, policy="frequency-distance"),
                dict(ram=5 * entry_bytes, policy="lru"),
                dict(ram=2 * entry_bytes, vram=2 * entry_bytes, device=vram_device, compute="fused-float"),
                dict(ram=0, vram=4 * entry_bytes, device=vram_device, policy="frequency-distance",
                     compute="fused-float")]
    for options in settings:
        model = edgemoe.load(store, **options)
        assert greedy(model) == (expected_float if "vram" in options else expected), options
        stats = model.store.stats
        assert stats.ram.peak_bytes <= (options["ram"] or 0) and stats.vram.peak_bytes <= options.get("vram", 0)


def test_a_model_owns_its_store_and_is_freed_when_closed_without_the_garbage_collector(store, checkpoint):
    import gc
    import weakref

    from edgemoe.options import cli_flag

    gc.disable()    # a reference cycle would keep the model (and its dense weights) alive from here on
    try:
        with edgemoe.load(store, preload="lookahead", ram="50%") as model:
            greedy(model, n=3)
            readers = model.store._loaders
            assert len(readers) == model.store.readers and all(r.is_alive() for r in readers)
            assert model.preloader is not None
        assert not any(r.is_alive() for r in readers) and model.preloader is None and model.routing_hooks == []
        alive = weakref.ref(model)
        del model
        assert alive() is None
    finally:
        gc.enable()
    with pytest.raises(ValueError, match="--ram applies to stores, and this is a checkpoint directory"):
        edgemoe.load(checkpoint, store=edgemoe.StoreOptions(ram="1GiB", name=cli_flag))


def test_vram_tier_matches_ram_logits(store, vram_device):
    ids = tokens(edgemoe.load(store))
    ram_logits = edgemoe.load(store, compute="fused-float").logits(ids)
    model = edgemoe.load(store, ram=0, vram="1GB", device=vram_device)
    assert (model.logits(ids) - ram_logits).abs().max() <= 1e-4
    assert set(model.store.resident().values()) == {"vram"}


@pytest.mark.parametrize("options", [dict(ram=0, vram="1GB"),                       # resident on the device
                                     dict(ram="1GB", vram=1, compute="device"),     # copied over per use
                                     dict(ram="1GB", vram="50%")])                  # half of each
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])                  # the dense matrices
def test_a_layers_device_experts_in_one_round_trip_give_the_bits_of_one_call_each(store, vram_device, options,
                                                                                     dtype):
    ids = tokens(edgemoe.load(store))
    with edgemoe.load(store, dtype, device=vram_device, preload="none", **options) as model:
        for entry in model.store.experts():       # every expert resident: each computes where it stays
            model.store.get(*entry.key)
        where = model.store.resident()
        assert len(where) == len(model.store.manifest.experts)
        assert "vram" in where.values() or options.get("compute") == "device"
        batched = model.logits(ids)
        model.experts.layer_kernel = False        # ExpertProvider.run: one call (and one wait) per expert
        assert torch.equal(model.logits(ids), batched) and model.store.resident() == where


@pytest.mark.parametrize("options", [dict(ram=0, vram="1GB"),                       # resident on the device
                                     dict(ram="1GB", vram=1, compute="device")])    # copied over per use
def test_a_layers_device_experts_dequantized_together_compute_what_each_alone_does(store, vram_device, options,
                                                                                      monkeypatch):
    """Batched dequantization, one batch a layer or several under a cap of two experts' float bytes,
    in prefill (one product per expert) and decode (one batched product per matrix): within float32
    rounding of each expert dequantized alone (device_batch_bytes=0), and batched as asked."""
    import edgemoe.quantized as quantized
    from edgemoe.kernels.device import DEVICE_BATCH_BYTES, float_bytes
    batches = []
    batched = quantized.swiglu_batch_on_device
    monkeypatch.setattr(quantized, "swiglu_batch_on_device",
                        lambda x, counts, meta, arrays: batches.append(counts) or batched(x, counts, meta, arrays))
    ids = tokens(edgemoe.load(store))
    logits, seen = {}, {}
    with edgemoe.load(store, device=vram_device, preload="none", **options) as model:
        for entry in model.store.experts():       # every expert resident: each computes where it stays
            model.store.get(*entry.key)
        two_experts = 2 * float_bytes(next(iter(model.store.experts())).tensors)
        for cap in (0, two_experts, DEVICE_BATCH_BYTES):
            model.experts.device_batch_bytes = cap
            batches.clear()
            logits[cap] = torch.cat([model.logits(ids), decode(model, ids)])     # a prefill, then steps
            seen[cap] = list(batches)
        top_k, experts = model.spec.top_k, model.spec.num_experts
    assert seen[0] == [] and max(map(len, seen[two_experts])) == 2
    one_batch = seen[DEVICE_BATCH_BYTES]
    assert [len(c) for c in one_batch if set(c) == {1}] == [top_k] * len(ids) * 2   # decode: 2 MoE layers a step
    assert max(map(len, one_batch)) == experts                                # prefill: the whole layer
    for cap in (two_experts, DEVICE_BATCH_BYTES):
        assert (logits[cap] - logits[0]).abs().max() <= 1e-4
        assert torch.equal(logits[cap].argmax(-1), logits[0].argmax(-1))


def test_vram_tier_and_ram_agree_on_the_bundled_model(tmp_path, vram_device):
    """The device path sums in another order than the CPU kernels: float32 rounding only. With float32
    dense matrices greedy text is the same; bfloat16 ones round each GEMM's output to bfloat16, which
    turns that rounding into bfloat16 steps of the logits (measured: at most 0.125 at logits of 12-17,
    KL 3e-6 to 2e-5; docs/architecture.md)."""
    from edgemoe.bundled import bundled_model_path
    store = tmp_path / "bundled"
    convert(bundled_model_path(), store, bits=4)
    # RAM experts on the float kernels: the integer path ("auto" may pick it) rounds activations to int8
    ram = edgemoe.load(store, torch.float32, preload="none", compute="fused-float")
    vram = edgemoe.load(store, torch.float32, preload="none", ram=0, vram="1GB", device=vram_device)
    for prompt in ("ROMEO:", "JULIET:\nO", "To be, or not"):
        ids = ram.tokenizer.encode(prompt)
        assert (ram.logits(ids) - vram.logits(ids)).abs().max() <= 1e-4
        assert ram.generate(prompt, max_new_tokens=100, temperature=0) == \
            vram.generate(prompt, max_new_tokens=100, temperature=0)
    ram16 = edgemoe.load(store, torch.bfloat16, preload="none", compute="fused-float")
    vram16 = edgemoe.load(store, torch.bfloat16, preload="none", ram=0, vram="1GB", device=vram_device)
    ids = ram16.tokenizer.encode("ROMEO:")
    a, b = ram16.logits(ids), vram16.logits(ids)
    kl = torch.nn.functional.kl_div(b.log_softmax(-1), a.log_softmax(-1), log_target=True, reduction="batchmean")
    assert (a - b).abs().max() <= 0.02 * a.abs().max() and kl <= 1e-4 and torch.equal(a.argmax(-1), b.argmax(-1))


def test_tiers_are_exclusive_and_demote_from_vram_to_ram(store, vram_device):
    size = max(e.length for e in read_manifest(store).experts.values())
    with open_store(store, ram=2 * size, vram=2 * size, device=vram_device) as s:
        for e in range(4):
            s.get(0, e)
        where = s.resident()
        assert list(where.values()).count("vram") == 2 and list(where.values()).count("ram") == 2
        assert s.stats.vram.evictions == 2 and s.stats.vram.bytes <= 2 * size
        s.get(0, 0)                                   # in RAM now: a hit, not a disk read
        assert s.stats.misses == 4 and s.stats.ram.hits == 1


def test_lru_and_frequency_distance_policies_choose_different_victims(store):
    size = max(e.length for e in read_manifest(store).experts.values())
    choices = {}
    for policy in ("lru", "frequency-distance"):
        with open_store(store, ram=3 * size, policy=policy) as s:
            s.begin_layer(0)
            for _ in range(3):
                s.get(0, 0)                            # frequent, layer 0
            s.begin_layer(2)
            s.get(2, 1)
            s.get(2, 2)
            s.begin_layer(2)
            s.get(2, 3)                                # needs room: evict one of (0,0), (2,1), (2,2)
            choices[policy] = sorted(s.resident())
    assert choices["lru"] == [(2, 1), (2, 2), (2, 3)]          # the least recently used went
    assert choices["frequency-distance"] == [(0, 0), (2, 2), (2, 3)]      # frequent and soon-needed (0,0) stays


def test_budget_smaller_than_one_expert_streams_without_caching(store):
    with open_store(store, ram=100) as s:
        a = s.get(0, 1)
        assert s.stats.streamed == 1 and s.resident() == {}
        assert a.dequantize()["gate"].shape == a.dequantize()["up"].shape


def test_prefetch_loads_in_background_and_counts_use_and_waste(store):
    size = max(e.length for e in read_manifest(store).experts.values())
    with open_store(store, ram=2 * size) as s:
        s.prefetch([(0, 2), (0, 3)])
        s.drain()
        s.get(0, 2)
        s.get(0, 3)
        assert (s.stats.misses, s.stats.ram.hits, s.stats.preloads_loaded, s.stats.preloads_used) == (0, 2, 2, 2)
        s.prefetch([(2, 0), (2, 1)])
        s.drain()                                      # they evicted the used (0, 2), (0, 3)
        s.prefetch([(0, 0), (0, 1)])
        s.drain()                                      # these evict (2, 0), (2, 1), never used
        assert s.stats.preloads_wasted == 2 and sorted(s.resident()) == [(0, 0), (0, 1)]
        s.prefetch([(0, 0)])                           # already resident: not issued again
        assert s.stats.preloads_issued == 6
        s.prefetch([(0, 4)])                           # a layer's unused preloads do not push each other out
        s.drain()
        assert sorted(s.resident()) == [(0, 0), (0, 1)] and s.stats.streamed == 1


def test_the_running_layers_experts_are_never_evicted_to_place_others(store):
    size = max(e.length for e in read_manifest(store).experts.values())
    with open_store(store, ram=2 * size) as s:
        s.begin_layer(0, needed=[(0, 0), (0, 1)])
        s.get(0, 0)
        s.get(0, 1)
        s.prefetch([(2, 0)])                           # the next layer's prediction: no room, no eviction
        s.drain()
        assert sorted(s.resident()) == [(0, 0), (0, 1)]
        s.begin_layer(2, needed=[(2, 0)])
        s.get(2, 0)                                    # layer 0 is done: now it may go
        assert (2, 0) in s.resident()


def test_many_threads_share_a_store(store):
    size = max(e.length for e in read_manifest(store).experts.values())
    expected = {}
    with open_store(store) as s:
        for key in read_manifest(store).experts:
            expected[key] = s.get(*key).dequantize()["down"]
    errors = []
    with open_store(store, ram=3 * size, policy="frequency-distance") as s:
        def worker(seed):
            g = torch.Generator().manual_seed(seed)
            keys = sorted(expected)
            try:
                for _ in range(40):
                    key = keys[int(torch.randint(len(keys), (1,), generator=g))]
                    s.prefetch([keys[int(torch.randint(len(keys), (1,), generator=g))]])
                    assert torch.equal(s.get(*key).dequantize()["down"], expected[key])
            except BaseException as exc:
                errors.append(exc)
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        assert s.stats.ram.bytes <= 3 * size and s.stats.ram.peak_bytes <= 3 * size
        assert s.stats.requests == 160


def test_existing_output_is_refused_unless_forced(checkpoint, store, tmp_path):
    with pytest.raises(StoreError, match="already exists"):
        convert(checkpoint, store)
    out = tmp_path / "s"
    convert(checkpoint, out, bits=8)
    convert(checkpoint, out, bits=2, force=True)
    assert {e.bits for e in read_manifest(out).experts.values()} == {2}


def snapshot(path):
    """Every file under path (or path itself) with its bytes."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return {str(f): f.read_bytes() for f in files}


@pytest.mark.parametrize("where", ["the checkpoint", "its parent"])
def test_force_never_replaces_an_input(checkpoint, tmp_path, where):
    source = tmp_path / "ckpt"
    shutil.copytree(checkpoint, source)
    out = source if where == "the checkpoint" else tmp_path
    before = snapshot(source)
    with pytest.raises(OutputError, match="(is|contains) the input"):
        convert(source, out, bits=4, force=True)
    assert snapshot(source) == before


@pytest.mark.parametrize("kind", ["directory", "file"])
def test_force_replaces_only_a_store(checkpoint, tmp_path, kind):
    out = tmp_path / "out"
    if kind == "directory":
        out.mkdir()
        (out / "notes.txt").write_text("keep me")
    else:
        out.write_text("keep me")
    before = snapshot(out)
    with pytest.raises(StoreError, match="not an edgemoe store.*left untouched"):
        convert(checkpoint, out, bits=4, force=True)
    assert snapshot(out) == before
    assert list(tmp_path.iterdir()) == [out]   # no partial store left behind


def test_a_failed_convert_leaves_nothing_that_opens(checkpoint, tmp_path):
    def fail(stage, done, total):
        if done == 3:
            raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        convert(checkpoint, tmp_path / "s", progress=fail)
    assert list(tmp_path.iterdir()) == []


def test_a_killed_convert_leaves_no_store_and_the_next_one_cleans_up(checkpoint, tmp_path):
    out = tmp_path / "s"
    code = ("import os, sys; from edgemoe.convert import convert; "
            f"convert({str(checkpoint)!r}, {str(out)!r}, progress=lambda s, d, t: d == 3 and os.kill(os.getpid(), 9))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True)
    assert proc.returncode == -9
    assert not out.exists()
    partials = list(tmp_path.glob("s.partial-*"))
    assert len(partials) == 1 and not (partials[0] / MANIFEST).exists()
    with pytest.raises(StoreError, match="no manifest.json"):
        edgemoe.load(partials[0])
    convert(checkpoint, out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s"]


def copy_store(store, tmp_path):
    import shutil
    shutil.copytree(store, tmp_path / "copy")
    return tmp_path / "copy"


def test_truncated_data_file_is_detected_at_open(store, tmp_path):
    s = copy_store(store, tmp_path)
    data = s / "experts-00000.bin"
    os.truncate(data, data.stat().st_size - ALIGNMENT)
    with pytest.raises(StoreError, match="experts-00000.bin: .* bytes, the manifest says"):
        edgemoe.load(s)


def test_flipped_byte_inside_a_blob_names_layer_expert_and_file(store, tmp_path):
    s = copy_store(store, tmp_path)
    entry = read_manifest(s).experts[2, 4]
    with open(s / "experts-00000.bin", "r+b") as f:
        f.seek(entry.offset + 100)
        byte = f.read(1)
        f.seek(entry.offset + 100)
        f.write(bytes([byte[0] ^ 0x10]))
    with open_store(s) as opened:
        opened.get(2, 3)
        with pytest.raises(StoreError, match=r"checksum mismatch for layer 2 expert 4 \(experts-00000.bin"):
            opened.get(2, 4)
    with open_store(s) as opened:                   # a corrupt preload surfaces in the caller
        opened.prefetch([(2, 4)])
        opened._loads.join()
        with pytest.raises(StoreError, match="checksum mismatch for layer 2 expert 4"):
            opened.get(0, 0)


def test_corrupt_dense_file_is_detected(store, tmp_path):
    s = copy_store(store, tmp_path)
    with open(s / "dense.safetensors", "r+b") as f:
        f.seek(-10, os.SEEK_END)
        tail = f.read(4)
        f.seek(-10, os.SEEK_END)
        f.write(bytes(b ^ 0xFF for b in tail))
    with pytest.raises(StoreError, match="dense.safetensors: checksum mismatch"):
        edgemoe.load(s)


@pytest.mark.parametrize("change,message", [
    (lambda m: None, "no manifest.json"),
    (lambda m: {**m, "version": 99}, "version 99 is not supported"),
    (lambda m: {**m, "complete": False}, "marked incomplete"),
    (lambda m: {**m, "format": "other"}, "not an edgemoe store"),
    (lambda m: {**m, "experts": m["experts"][1:]}, "manifest lists"),
])
def test_bad_manifests_are_refused(store, tmp_path, change, message):
    s = copy_store(store, tmp_path)
    manifest = json.loads((s / MANIFEST).read_text())
    changed = change(manifest)
    if changed is None:
        (s / MANIFEST).unlink()
    else:
        (s / MANIFEST).write_text(json.dumps(changed))
    with pytest.raises(StoreError, match=message):
        edgemoe.load(s)


def test_two_processes_read_one_store_at_once(store):
    code = ("import sys, edgemoe; from edgemoe.generate import GenerationOptions, generate_batch; "
            f"m = edgemoe.load({str(store)!r}, ram=30000); "
            "print(generate_batch(m, [m.tokenizer.encode('To be, or not')], GenerationOptions(max_new_tokens=12, "
            "stop_token_ids=[]))[0])")
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [p.communicate(timeout=120)[0].strip() for p in procs]
    expected = str(greedy(edgemoe.load(store))[0])
    assert outputs == [expected, expected]


def test_budget_strings_and_errors(store):
    from edgemoe.options import OptionError
    from edgemoe.store import parse_bytes
    assert parse_bytes("512MiB", "ram=") == 512 * 2**20 and parse_bytes("2GB", "ram=") == 2 * 10**9
    assert parse_bytes(4096, "ram=") == 4096 and parse_bytes("1.5k", "ram=") == 1500
    assert parse_bytes("25%", "ram=", share_of=1000) == 250
    for bad in ("lots", "inf", "nan", "-5", "-1MiB", "25%"):   # a share needs the total it is a share of
        with pytest.raises(OptionError, match=f"--ram {bad!r}"):
            parse_bytes(bad, "--ram")
    with pytest.raises(OptionError, match="ram=-5"):
        parse_bytes(-5, "ram=")
    with pytest.raises(OptionError, match="ram='150%': expected a percentage"):
        open_store(store, ram="150%")
    with open_store(store, ram="50%") as s:
        assert s.ram_capacity == int(0.5 * s.manifest.expert_bytes)
    if not torch.cuda.is_available():
        with pytest.raises(OptionError, match="device='cuda'.*no usable cuda"):
            open_store(store, vram="1GB", device="cuda")


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3", "phimoe",
                                  "gpt_oss"])
def test_convert_run_and_inspect_every_architecture(tiny_model, tmp_path, arch):
    path = tiny_model(arch, fused_experts=arch == "olmoe")
    convert(path, tmp_path / "s", bits=4)
    model = edgemoe.load(tmp_path / "s", ram=30_000, policy="frequency-distance", compute="fused-float")
    reference = dequantized_reference(path, lambda key: 4)
    ids = tokens(model)
    assert (model.logits(ids) - reference.logits(ids)).abs().max() <= 1e-4
    assert model.generate("To be", max_new_tokens=5, stop_token_ids=[]) == \
        reference.generate("To be", max_new_tokens=5, stop_token_ids=[])
    summary = inspect_store(tmp_path / "s")
    assert summary["model"]["model_type"] == arch
    assert sum(row["widths"]["4"] for row in summary["layers"]) == len(model.spec.moe_layer_ids) * model.spec.num_experts


def test_missing_lists_experts_neither_resident_nor_being_read(store):
    with open_store(store, place_popular=False) as s:
        s.get(0, 0)
        assert s.missing([(2, 3), (0, 0), (0, 1)]) == [(2, 3), (0, 1)]   # order kept, resident dropped
        read = threading.Event()
        s._read = lambda key, narrowed=False, preload=False, _read=s._read: (read.wait(5),
                                                                             _read(key, narrowed, preload))[1]
        s.prefetch([(2, 3)])
        for _ in range(5000):                         # until the loader has taken it: a read under way
            if len(s._loads) == 0:
                break
            threading.Event().wait(0.001)
        assert s.missing([(2, 3), (0, 1)]) == [(0, 1)]
        read.set()
        s.drain()
        assert (2, 3) in s.resident()


def test_dequantized_experts_multiply_in_the_dense_matrices_type(tiny_model, tmp_path):
    """A bfloat16 model on a CPU that multiplies bfloat16 natively: the "dequant" path's matrices and
    GEMM in bfloat16, each expert's output that of plain torch on the reference dequantization in
    bfloat16; forced to float32 (--dtype), float32 again."""
    import torch.nn.functional as F
    from edgemoe.precision import native_types
    convert(tiny_model("mixtral", dtype="bfloat16"), tmp_path / "s", bits=4)
    for dtype, expected in ((None, torch.bfloat16 if torch.bfloat16 in native_types() else torch.float32),
                            (torch.float32, torch.float32)):
        with edgemoe.load(tmp_path / "s", compute="dequant", dtype=dtype) as model:
            assert model.experts.gemm_dtype == expected
            expert = model.experts.expert(0, 1)
            x = torch.randn(5, model.spec.hidden_size, generator=torch.Generator().manual_seed(0))
            w = {role: dequantize_reference(qt).to(expected) for role, qt in expert.resident.tensors.items()}
            plain = F.linear((F.silu(F.linear(x.to(expected), w["gate"]).float())
                              * F.linear(x.to(expected), w["up"]).float()).to(expected), w["down"]).float()
            assert torch.equal(expert(x), plain)
