"""--ram auto: the RAM tier sized from the memory this process may still take (docs/scheduling.md,
"The RAM budget chosen for you")."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import edgemoe
from edgemoe.bench import CGROUP_V1_MEMORY, remove_memory_group
from edgemoe.convert import convert
from edgemoe.loader import StoreOptions, auto_ram, dense_bytes, run_needs
from edgemoe.options import OptionError
from edgemoe.store import read_manifest
from edgemoe.generate import GenerationOptions, generate_batch, stream_tokens
from edgemoe.ram_growth import GROWTH_WATCH_STEPS, RamGrowth
from edgemoe.store.memory import (GROWN_MARGIN_FIXED, GROWN_MARGIN_SHARE, MARGIN_FIXED, MIB, MemoryFacts, PeakWatch,
                                  grown_ram_budget, ram_budget, read_memory_facts)

from helpers import run_cli

GIB = 1024 * MIB


# ---- the pure computation -----------------------------------------------------------------------

def test_under_a_cgroup_limit_the_budget_is_what_the_run_leaves():
    facts = MemoryFacts(1000 * MIB, "cgroup /g", limit=1200 * MIB, usage=400 * MIB, reclaimable=200 * MIB)
    needs = {"dense": 100 * MIB, "kv_cache": 10 * MIB, "runtime": 128 * MIB}
    budget, breakdown = ram_budget(facts, 2 * GIB, needs)
    # margin 64 MiB + 5% of 1000 MiB = 114 MiB; 1000 - 238 - 114 = 648 MiB.
    assert budget == 648 * MIB
    assert breakdown["margin"] == 114 * MIB and breakdown["budget"] == budget
    assert breakdown["dense"] == 100 * MIB and breakdown["limit"] == 1200 * MIB and "note" not in breakdown


def test_without_a_cgroup_memavailable_counts_and_more_than_enough_gives_every_expert():
    facts = MemoryFacts(8 * GIB, "/proc/meminfo MemAvailable")
    budget, _ = ram_budget(facts, 1 * GIB, {"dense": 200 * MIB, "runtime": 128 * MIB})
    assert budget == 1 * GIB    # 8 GiB - 328 MiB - 473.6 MiB leaves more than the experts


def test_a_tiny_limit_gives_zero_never_less_and_says_every_expert_is_streamed():
    budget, breakdown = ram_budget(MemoryFacts(150 * MIB, "cgroup /g"), GIB, {"runtime": 128 * MIB})
    assert budget == 0 and breakdown["budget"] == 0
    assert "read from disk" in breakdown["note"]
    # 74 MiB available, nothing else held: 74 - 64 - 3.7 MiB of margin.
    assert ram_budget(MemoryFacts(MARGIN_FIXED + 10 * MIB, "x"), GIB, {})[0] == 10 * MIB - int(0.05 * 74 * MIB)


def test_unknown_memory_falls_back_to_every_expert_with_the_reason():
    budget, breakdown = ram_budget(MemoryFacts(None, "unknown"), 3 * GIB, {"runtime": 128 * MIB})
    assert budget == 3 * GIB and "could not be read" in breakdown["note"]


def test_the_second_look_grows_by_what_is_left_after_the_step_peak_the_kv_growth_and_unfilled_room():
    facts = MemoryFacts(300 * MIB, "cgroup /g", limit=1000 * MIB, usage=700 * MIB, reclaimable=0)
    margin = GROWN_MARGIN_FIXED + int(GROWN_MARGIN_SHARE * 1000 * MIB)
    grown, why = grown_ram_budget(facts, 400 * MIB, 390 * MIB, GIB, transient=20 * MIB, future=5 * MIB)
    assert why["margin"] == margin
    assert grown == 400 * MIB + (300 - 20 - 5 - 10) * MIB - margin == 400 * MIB + why["grown_by"]


def test_the_second_look_never_shrinks_never_passes_every_expert_and_leaves_unknown_memory_alone():
    tight = MemoryFacts(10 * MIB, "cgroup /g", limit=1000 * MIB, usage=990 * MIB, reclaimable=0)
    assert grown_ram_budget(tight, 400 * MIB, 400 * MIB, GIB, 20 * MIB, 0)[0] == 400 * MIB
    roomy = MemoryFacts(8 * GIB, "/proc/meminfo MemAvailable")
    assert grown_ram_budget(roomy, 400 * MIB, 400 * MIB, GIB, 20 * MIB, 0)[0] == GIB
    unknown = MemoryFacts(None, "unknown")
    assert grown_ram_budget(unknown, 400 * MIB, 400 * MIB, GIB, 0, 0) == (400 * MIB, {
        "available": None, "cached": 400 * MIB, "transient": 0, "future": 0, "capacity_before": 400 * MIB,
        "margin": 0, "grown_by": 0})


def _fake_proc(root: Path, hwm_kib: int, rss_kib: int) -> Path:
    return _tree(root, {"clear_refs": "", "status": f"Name:\tpython\nVmHWM:\t{hwm_kib} kB\nVmRSS:\t{rss_kib} kB\n"})


def test_the_peak_watch_resets_the_peak_and_reads_it_above_the_level_now(tmp_path):
    proc = _fake_proc(tmp_path, hwm_kib=5000, rss_kib=4000)
    watch = PeakWatch(proc)
    assert watch.usable and (proc / "clear_refs").read_text() == "5"
    assert watch.above_now() == 1000 * 1024
    (proc / "status").write_text("VmRSS: 4000 kB\n")      # no VmHWM (an old kernel): unreadable
    assert watch.above_now() is None and not watch.reset()
    assert not PeakWatch(tmp_path / "missing").usable


# ---- the reader, on fake /proc and /sys trees ----------------------------------------------------

def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


MEMINFO = "MemTotal:       16000000 kB\nMemFree:  1000 kB\nMemAvailable:    4000000 kB\n"


def test_cgroup_v1_limit_less_usage_with_only_inactive_file_pages_reclaimable(tmp_path):
    g = "sys/fs/cgroup/memory/jobs/one"
    root = _tree(tmp_path, {"proc/self/cgroup": "5:memory:/jobs/one\n1:cpu:/\n0::/\n", "proc/meminfo": MEMINFO,
                            f"{g}/memory.limit_in_bytes": str(GIB), f"{g}/memory.usage_in_bytes": str(600 * MIB),
                            f"{g}/memory.stat": f"cache {300 * MIB}\ntotal_inactive_file {100 * MIB}\n"
                                                f"total_active_file {150 * MIB}\n"
                                                f"hierarchical_memory_limit {GIB}\n"})
    facts = read_memory_facts(root)
    assert facts.available == GIB - (600 - 100) * MIB      # active file pages are not counted as free
    assert (facts.limit, facts.usage, facts.reclaimable) == (GIB, 600 * MIB, 100 * MIB)
    assert facts.source.endswith("memory/jobs/one")


def test_cgroup_v1_a_parent_limit_smaller_than_the_group_s_is_the_one_that_bites(tmp_path):
    g = "sys/fs/cgroup/memory/jobs/one"
    root = _tree(tmp_path, {"proc/self/cgroup": "5:memory:/jobs/one\n", f"{g}/memory.limit_in_bytes": str(1 << 62),
                            f"{g}/memory.usage_in_bytes": str(100 * MIB),
                            f"{g}/memory.stat": f"hierarchical_memory_limit {512 * MIB}\n"})
    assert read_memory_facts(root).available == 412 * MIB


def test_cgroup_v1_without_a_limit_falls_back_to_memavailable(tmp_path):
    g = "sys/fs/cgroup/memory/jobs/one"
    root = _tree(tmp_path, {"proc/self/cgroup": "5:memory:/jobs/one\n", "proc/meminfo": MEMINFO,
                            f"{g}/memory.limit_in_bytes": "9223372036854771712",
                            f"{g}/memory.usage_in_bytes": str(100 * MIB), f"{g}/memory.stat": ""})
    facts = read_memory_facts(root)
    assert facts.available == 4000000 * 1024 and facts.source == "/proc/meminfo MemAvailable"


def test_cgroup_v1_with_an_unreadable_limit_falls_back_to_memavailable(tmp_path):
    g = "sys/fs/cgroup/memory/jobs/one"
    root = _tree(tmp_path, {"proc/self/cgroup": "5:memory:/jobs/one\n", "proc/meminfo": MEMINFO,
                            f"{g}/memory.limit_in_bytes": "", f"{g}/memory.stat": ""})
    assert read_memory_facts(root).source == "/proc/meminfo MemAvailable"


def test_cgroup_v1_in_a_namespace_reads_the_mount_itself(tmp_path):
    """A cgroup namespace shows the process's group as "/": the controller's mount is the group."""
    m = "sys/fs/cgroup/memory"
    root = _tree(tmp_path, {"proc/self/cgroup": "5:memory:/\n", f"{m}/memory.limit_in_bytes": str(GIB),
                            f"{m}/memory.usage_in_bytes": str(GIB // 2), f"{m}/memory.stat": ""})
    assert read_memory_facts(root).available == GIB // 2


def test_cgroup_v2_smallest_limit_up_the_tree_less_usage_plus_inactive_file(tmp_path):
    g = "sys/fs/cgroup/user.slice/app"
    root = _tree(tmp_path, {"proc/self/cgroup": "0::/user.slice/app\n", "proc/meminfo": MEMINFO,
                            f"{g}/memory.max": "max\n", "sys/fs/cgroup/user.slice/memory.max": f"{2 * GIB}\n",
                            f"{g}/memory.current": str(GIB),
                            f"{g}/memory.stat": f"file {500 * MIB}\ninactive_file {200 * MIB}\n"
                                                f"active_file {300 * MIB}\n"})
    facts = read_memory_facts(root)
    assert facts.available == 2 * GIB - (1024 - 200) * MIB and facts.limit == 2 * GIB


def test_cgroup_v2_with_no_limit_anywhere_uses_memavailable(tmp_path):
    g = "sys/fs/cgroup/user.slice/app"
    root = _tree(tmp_path, {"proc/self/cgroup": "0::/user.slice/app\n", "proc/meminfo": MEMINFO,
                            f"{g}/memory.max": "max\n", f"{g}/memory.current": str(GIB)})
    assert read_memory_facts(root).available == 4000000 * 1024


def test_nothing_readable_is_unknown(tmp_path):
    facts = read_memory_facts(tmp_path)
    assert facts.available is None and facts.source.startswith("unknown")


# ---- the options and the run's sizes ---------------------------------------------------------------

@pytest.fixture(scope="module")
def store(tiny_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("ram-auto") / "store"
    convert(tiny_model("mixtral"), out, bits=4)
    return out


def test_store_options_take_auto_and_refuse_a_wrong_word_naming_the_option():
    assert StoreOptions(ram="auto").ram == "auto"
    assert StoreOptions(ram="auto").given() == []    # the commands' default asks nothing of a checkpoint
    with pytest.raises(OptionError, match=r"ram='automatic'.*or auto"):
        StoreOptions(ram="automatic")


def test_cli_refuses_a_wrong_ram_in_one_line(store, monkeypatch, capsys):
    code, err = run_cli(monkeypatch, capsys, "run", str(store), "-n", "1", "--ram", "lots")
    assert code == 2 and err.count("\n") == 0 and "--ram 'lots'" in err and "or auto" in err


def test_loading_with_auto_sets_the_capacity_to_the_budget(store):
    with edgemoe.load(store, ram="auto", context=32) as model:
        b = model.store.ram_breakdown
        assert model.store.ram_capacity == b["budget"]
        assert 0 <= b["budget"] <= b["expert_bytes"] == read_manifest(store).expert_bytes
        assert b["kv_cache"] == run_needs(read_manifest(store), None, "auto", 32, 1)["kv_cache"]
    with edgemoe.load(store, ram="1MiB") as model:
        assert model.store.ram_breakdown is None


def _second_look_under(monkeypatch, memory_root: Path, proc: Path) -> list:
    """Every RamGrowth made from now on reads the fake trees given; returns the list they are put in."""
    made, make = [], RamGrowth.for_store.__func__

    def for_store(cls, store):
        growth = make(cls, store, memory_root=str(memory_root), proc=str(proc))
        made.append(growth)
        if growth is not None:   # record the tier's fill at each look and when the watch begins
            growth.looks, growth.watch_began, reset, filled = [], [], growth.watch.reset, growth.store.ram_filled
            growth.store.ram_filled = lambda: (growth.looks.append(filled()), growth.looks[-1])[1]
            growth.watch.reset = lambda: (growth.watch_began.append(growth.looks[-1]), reset())[1]
        return growth
    monkeypatch.setattr(RamGrowth, "for_store", classmethod(for_store))
    return made


def _decoded(model, tokens: int) -> list[int]:
    return list(stream_tokens(model, [1], GenerationOptions(max_new_tokens=tokens, stop_token_ids=[])))


def _fake_cgroup(root: Path, limit: int, usage: int) -> Path:
    m = "sys/fs/cgroup/memory"
    return _tree(root, {"proc/self/cgroup": "5:memory:/\n", f"{m}/memory.limit_in_bytes": str(limit),
                        f"{m}/memory.usage_in_bytes": str(usage), f"{m}/memory.stat": "total_inactive_file 0\n"})


@pytest.fixture(scope="module")
def store32(tiny_model, tmp_path_factory):
    """32 experts (4 layers x 8, top-2): half of them take several decode steps to fill."""
    out = tmp_path_factory.mktemp("ram-growth") / "store"
    convert(tiny_model("mixtral", num_local_experts=8, num_hidden_layers=4), out, bits=4)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("compute", ["fused-int", "dequant"])
def test_plain_decoding_grows_a_full_auto_tier_once_by_what_memory_allows_and_the_text_does_not_change(
        store32, tmp_path, monkeypatch, dtype, compute):
    """A RAM tier sized by auto at half of the experts (faked here), decoding 40 tokens: once the
    tier is full and GROWTH_WATCH_STEPS steps were watched, it grows once by what the (fake) memory
    facts leave after the step peak, the KV cache's growth, the room still unfilled and the margin,
    and returns to its first size when the sequence ends; the tokens are those of a model that
    caches every expert."""
    expert_bytes = read_manifest(store32).expert_bytes
    # One compute path for both, each forced: the machine's calibration, made in this test session,
    # may choose another for a read expert than the all-resident step's kernel uses, under load.
    with edgemoe.load(store32, dtype, compute=compute) as unbounded:
        expected = _decoded(unbounded, 40)
    margin = GROWN_MARGIN_FIXED + int(GROWN_MARGIN_SHARE * GIB)
    available = margin + MIB + expert_bytes // 4                # the step peak (1 MiB) and a quarter more
    made = _second_look_under(monkeypatch, _fake_cgroup(tmp_path / "memory", GIB, GIB - available),
                              _fake_proc(tmp_path / "proc", hwm_kib=5 * 1024, rss_kib=4 * 1024))
    with edgemoe.load(store32, dtype, ram=expert_bytes // 2, compute=compute) as model:
        model.store.ram_breakdown = {"available": GIB, "kv_cache": 0}     # as if auto had chosen it
        resize = model.store.resize_ram
        calls = []
        monkeypatch.setattr(model.store, "resize_ram", lambda capacity: (calls.append(capacity), resize(capacity)))
        assert _decoded(model, 40) == expected
        g = model.store.ram_breakdown["grown"]
        assert len(made) == 1 and calls == [expert_bytes // 2 + g["grown_by"], expert_bytes // 2]   # grown, returned
        assert g["capacity_before"] == expert_bytes // 2 and g["transient"] == MIB and g["margin"] == margin
        largest = max(e.length for e in model.store.manifest.experts.values())
        (cached, capacity), = made[0].watch_began                         # watched once the tier was full,
        assert capacity - cached < largest <= capacity - made[0].looks[0][0]   # not while it filled
        assert g["after_tokens"] >= GROWTH_WATCH_STEPS + 1
        room = available - MIB - g["future"] - (g["capacity_before"] - g["cached"]) - margin
        assert g["grown_by"] == min(room, expert_bytes - g["capacity_before"]) > 0
        assert model.store.stats.ram.peak_bytes > expert_bytes // 2       # the grown room was used
        # The sequence over, the tier is back at its first size for the next prompt's prefill.
        assert model.store.ram_capacity == model.store.cache.tiers[-1].capacity == expert_bytes // 2
        assert model.store.stats.ram.bytes <= expert_bytes // 2


def test_batches_and_stores_not_sized_by_auto_keep_their_budget(store, tmp_path, monkeypatch):
    expert_bytes = read_manifest(store).expert_bytes
    made = _second_look_under(monkeypatch, _fake_cgroup(tmp_path / "memory", GIB, 0),
                              _fake_proc(tmp_path / "proc", hwm_kib=4096, rss_kib=4096))
    with edgemoe.load(store, ram=expert_bytes // 4) as model:
        _decoded(model, 30)              # no ram_breakdown: a hand-picked budget
        assert made == [None] and model.store.ram_capacity == expert_bytes // 4
        model.store.ram_breakdown = {"available": GIB, "kv_cache": 0}
        generate_batch(model, [[1, 2, 3], [4, 5]], GenerationOptions(max_new_tokens=30, stop_token_ids=[]))
        assert model.store.ram_capacity == expert_bytes // 4 and "grown" not in model.store.ram_breakdown


def test_run_needs_follow_the_context_the_batch_the_cache_type_and_the_dense_width(store):
    manifest = read_manifest(store)
    spec = manifest.spec
    heads, key_dim, value_dim = spec.cache_layout
    per_token = spec.num_layers * heads * (key_dim + value_dim) * 4
    needs = run_needs(manifest, None, "auto", 100, 3)
    assert needs["kv_cache"] == 3 * per_token * 200              # doubling: room for twice the tokens
    assert run_needs(manifest, None, "auto", 100, 3, "bfloat16")["kv_cache"] == needs["kv_cache"] // 2
    whole = run_needs(manifest, None, "auto", 10 ** 9, 1)["kv_cache"]     # the cache stops at the context,
    context = spec.max_position_embeddings                                # one layer's old arrays beside it
    assert whole == per_token * context + per_token // spec.num_layers * context
    as_loaded, int8 = (run_needs(manifest, None, bits, 100, 1)["dense"] for bits in ("none", 8))
    assert int8 < as_loaded        # the projections' float copies let go, their INT8 codes kept
    assert dense_bytes(manifest, None, "none") == as_loaded and dense_bytes(manifest, None, 8) == int8


def test_activations_count_the_logits_each_kind_of_run_keeps(store):
    """Generating, a prefill chunk keeps its last token's logits only (next_logits: one row a sequence);
    scoring a window (eval) keeps every position's logits and their log-softmax. On a vocabulary of
    150k a 512-token chunk's logits would be 297 MiB that generation never holds."""
    from dataclasses import replace
    from edgemoe.loader import activation_bytes
    manifest = read_manifest(store)
    spec = manifest.spec
    wider = replace(spec, vocab_size=spec.vocab_size + 1000)
    for tokens in (100, 2000):
        assert activation_bytes(wider, tokens) - activation_bytes(spec, tokens) == 4 * 1000
        assert activation_bytes(wider, tokens, True) - activation_bytes(spec, tokens, True) == 4 * 1000 * 2 * tokens
    generate, score = (run_needs(manifest, None, "auto", 300, 1, score_windows=s)["activations"] for s in (False, True))
    assert score > generate
    with edgemoe.load(store, ram=0) as model:
        logits = model.next_logits([[1, 2, 3], [4, 5]], [model.new_cache(), model.new_cache()])
        assert logits.shape == (2, spec.vocab_size)


def test_the_dense_weights_held_after_load_are_those_the_loaded_model_holds(store):
    """dense_bytes' first figure, against the loaded model's own tensors and codes: the embedding,
    routers and vectors as loaded, the quantized copies of the rest."""
    from edgemoe.bench import dense_bytes_per_token
    for bits in (8, 4):
        with edgemoe.load(store, ram=0, dense_bits=bits) as model:
            held = model.embed.nbytes + dense_bytes_per_token(model)
        estimate = dense_bytes(read_manifest(store), None, bits)
        assert estimate == held, bits


def test_kernels_not_yet_compiled_are_reserved_for(store, tmp_path):
    """numba keeps about 250 MiB for compiling the kernels: reserved only where its cache lacks them.
    An empty cache has not got them; once this process has called them (compiled or loaded, cache=True
    writes the index), it has."""
    from edgemoe.kernels.ops import kernels_compiled
    from edgemoe.store.memory import KERNEL_COMPILE_GROWTH
    check = "from edgemoe.kernels.ops import kernels_compiled; print(kernels_compiled())"
    empty = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=120,
                           env={**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba")})
    assert empty.stdout.strip() == "False", empty.stderr
    with edgemoe.load(store, ram=0, dense_bits=8) as model:   # integer dense and experts: both kernels
        model.generate(model.tokenizer.encode("ab"), max_new_tokens=1)
    assert kernels_compiled()
    assert "kernel_compile" not in run_needs(read_manifest(store), None, "auto", 32, 1)
    needs = {"dense": 100 * MIB, "runtime": 80 * MIB}
    facts = MemoryFacts(1000 * MIB, "cgroup /g")
    with_compile, breakdown = ram_budget(facts, 2 * GIB, {**needs, "kernel_compile": KERNEL_COMPILE_GROWTH})
    assert ram_budget(facts, 2 * GIB, needs)[0] - with_compile == KERNEL_COMPILE_GROWTH
    assert breakdown["kernel_compile"] == KERNEL_COMPILE_GROWTH


def test_experts_are_placed_only_after_the_dense_weights_load(store, monkeypatch):
    """A budget that holds every expert is filled when the store opens, but only once the dense
    weights have loaded: the load's passing extra never meets a full cache, so auto reserves none."""
    import edgemoe.loader as loader
    from edgemoe.store import TieredStore
    events = []
    read_dense, place = loader.read_store_dense, TieredStore.place
    monkeypatch.setattr(loader, "read_store_dense", lambda *a: (events.append("dense"), read_dense(*a))[1])
    monkeypatch.setattr(TieredStore, "place", lambda self: (events.append("place"), place(self))[1])
    with edgemoe.load(store, ram="100%", dense_bits=8) as model:
        assert events == ["dense", "place"] and model.store.holds_everything()


def test_auto_under_a_fake_cgroup_far_too_small_is_zero(store, tmp_path):
    m = "sys/fs/cgroup/memory"
    root = _tree(tmp_path, {"proc/self/cgroup": "5:memory:/\n", f"{m}/memory.limit_in_bytes": str(300 * MIB),
                            f"{m}/memory.usage_in_bytes": str(290 * MIB), f"{m}/memory.stat": ""})
    budget, breakdown = auto_ram(read_manifest(store), root=root)
    assert budget == 0 and breakdown["available"] == 10 * MIB


def test_inspect_prints_the_breakdown(store, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["edgemoe", "inspect", str(store), "--ram", "auto", "--json"])
    from edgemoe.cli import main
    with pytest.raises(SystemExit) as done:
        main()
    assert done.value.code in (0, None)
    shown = json.loads(capsys.readouterr().out)["ram_auto"]
    terms = {"available", "dense", "kv_cache", "activations", "read_buffers", "runtime", "margin", "budget"}
    assert terms <= set(shown) and 0 <= shown["budget"] <= shown["expert_bytes"]


# ---- a real run inside a cgroup v1 memory limit -----------------------------------------------------

def _cgroup_v1_writable() -> str | None:
    if sys.platform != "linux" or os.geteuid() != 0:
        return "needs Linux and root"
    if not os.access(CGROUP_V1_MEMORY / "cgroup.procs", os.W_OK):
        return f"no writable cgroup v1 memory controller at {CGROUP_V1_MEMORY}"
    return None


def _run_confined(store: Path, limit: int | None, *flags: str, tokens: int = 4) -> tuple[int, int, str, str]:
    """`python -m edgemoe run STORE -n TOKENS` in a fresh cgroup v1 memory group (limit bytes, None:
    unlimited): its exit status (negative: killed by that signal), the group's peak charge, its stderr
    and its stdout."""
    group = CGROUP_V1_MEMORY / f"edgemoe-test-ram-auto-{os.getpid()}"
    group.mkdir()
    try:
        if limit is not None:
            (group / "memory.limit_in_bytes").write_text(str(limit))
        command = (f'echo $$ > {group}/cgroup.procs && exec "$0" -m edgemoe run "$1" -n {tokens} --stats '
                   f'--prompt To_be_or_not_to_be_that_is_the_question_whether_tis_nobler_in_the_mind "${{@:2}}"')
        done = subprocess.run(["bash", "-c", command, sys.executable, str(store), *flags],
                              capture_output=True, text=True, timeout=120)
        return done.returncode, int((group / "memory.max_usage_in_bytes").read_text()), done.stderr, done.stdout
    finally:
        remove_memory_group(group)



@pytest.mark.skipif(_cgroup_v1_writable() is not None, reason=str(_cgroup_v1_writable()))
def test_auto_finishes_inside_a_limit_that_kills_an_unbounded_cache(tmp_path):
    """A store of 98 MiB of experts (4 layers x 8 experts of 3 MiB at INT8): streaming every expert
    (--ram 0) peaks at some P; inside P + 40 MiB caching every expert it reads (--ram 100%, what no
    --ram did before) is killed, and the default, --ram auto, finishes."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    from make_tiny_model import make_tiny_model
    checkpoint = make_tiny_model(tmp_path / "ckpt", "mixtral", dtype="bfloat16", hidden_size=256,
                                 intermediate_size=4096, num_local_experts=8, num_hidden_layers=4)
    convert(checkpoint, tmp_path / "store", bits=8)
    store = tmp_path / "store"
    # First unbounded: it also calibrates the compute path (--compute auto), once, into the test's cache.
    code, caching_peak, err, _ = _run_confined(store, None, "--ram", "100%")
    assert code == 0, err
    code, streaming_peak, err, _ = _run_confined(store, None, "--ram", "0")
    assert code == 0, err
    limit = streaming_peak + 40 * MIB
    assert caching_peak > limit
    code, _, _, _ = _run_confined(store, limit, "--ram", "100%")
    assert code == -9                          # the limit bites: the OOM killer ended it
    code, peak, err, _ = _run_confined(store, limit)
    assert code == 0, err
    assert "[stats] --ram auto:" in err and peak <= limit
    assert "warning: --ram auto: no room for experts" in err    # the limit leaves none: said, and it streams
    # Decoding longer, auto looks again once its (empty) tier is full and caches what the run left
    # room for, still inside the limit (every expert would not be: 100% was killed above); the text
    # is the unbounded run's.
    # (one compute path for both: a read expert's may differ from the all-resident kernel's by the calibration)
    code, _, _, text = _run_confined(store, None, "--ram", "100%", "--compute", "fused-int", tokens=24)
    assert code == 0
    code, peak, err, grown_text = _run_confined(store, limit + 20 * MIB, "--compute", "fused-int", tokens=24)
    assert code == 0, err
    grown = re.search(r"--ram auto, after \d+ tokens: grown by ([\d.]+) MiB", err)
    assert grown and float(grown.group(1)) > 0 and peak <= limit + 20 * MIB, err
    assert grown_text == text
