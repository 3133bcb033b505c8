"""edgemoe bench: every mode runs on one store, records carry the promised fields, limits follow
from the bandwidths, prefill reads each expert at most once per chunk, bad options are named."""

import json
import os
import sys

import pytest

import edgemoe
from edgemoe.bench import (RECORD_FIELDS, BenchConfig, Bandwidths, bench, confine_memory, dense_bytes_per_token,
                           disk_bandwidth, leave_memory_group, memory_bandwidth, parse_ram)
from edgemoe.cli import main
from edgemoe.tracing import trace_text
from edgemoe.replay import RoutingReplay
from edgemoe.store import read_manifest
from edgemoe.convert import convert
from edgemoe.scheduling.profile import TraceRecord, write_trace

TEXT = "Friends, Romans, countrymen, lend me your ears; I come to bury Caesar, not to praise him. " * 3
FIXED = Bandwidths(memory=10e9, disk=1e9)


@pytest.fixture(scope="module")
def store(tiny_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "store"
    convert(tiny_model("qwen3_moe", num_hidden_layers=4, num_experts=6), out, bits=4, calib_text=TEXT)   # profiled
    return out


def expert_bytes(store):
    return sum(e.length for e in read_manifest(store).experts.values())


def replay_of(records, store):
    spec = read_manifest(store).spec
    return RoutingReplay(records, spec.moe_layer_ids, spec.num_experts, spec.top_k)


def limit(record):
    seconds = max(record["disk_bytes_per_token"] / FIXED.disk, record["memory_bytes_per_token"] / FIXED.memory)
    return 1 / seconds


def test_every_mode_gives_a_record_with_its_limit(store):
    config = BenchConfig(ram=expert_bytes(store) // 4, prefill_tokens=(20,), decode_tokens=4, warmup_tokens=1,
                         repeats=2, cold=True)
    records, bandwidths = bench(store, config, bandwidths=FIXED)
    assert bandwidths is FIXED
    assert [r["mode"] for r in records] == ["all-in-ram", "on-demand-lru", "predictive"]
    dense = dense_bytes_per_token(edgemoe.load(store, preload="none", dense_bits=config.dense_bits))
    for r in records:
        assert set(RECORD_FIELDS) <= set(r) and r["repeats"] == 2 and r["prefill_tokens"] == 20
        assert r["ttft_s"] > 0 and r["decode_tok_s"] > 0
        assert r["limit_decode_tok_s"] == pytest.approx(limit(r))
        assert r["memory_bytes_per_token"] > dense          # dense weights plus the experts used
    in_ram, on_demand, scheme = records
    assert in_ram["hit_rate"] == 1.0 and in_ram["disk_bytes_per_token"] == 0
    assert in_ram["ram_bytes"] == expert_bytes(store)
    assert on_demand["ram_bytes"] == scheme["ram_bytes"] == expert_bytes(store) // 4
    assert on_demand["hit_rate"] < 1 and on_demand["disk_bytes_per_token"] > 0


def test_prefill_reads_each_expert_at_most_once_per_chunk(store):
    # A budget below one expert: nothing is cached, so every request is a read and the count of
    # reads is exactly the count of (chunk, expert used in the chunk) pairs.
    spec = read_manifest(store).spec
    config = BenchConfig(ram=1, modes=("on-demand-lru",), prefill_tokens=(40,), prefill_chunk=16,
                         decode_tokens=1, warmup_tokens=0, repeats=1)
    (record,), _ = bench(store, config, bandwidths=FIXED)
    assert record["prefill_disk_reads"] == record["prefill_expert_requests"]
    assert record["prefill_max_reads_per_chunk"] <= len(spec.moe_layer_ids) * spec.num_experts
    assert record["prefill_disk_reads"] <= 3 * len(spec.moe_layer_ids) * spec.num_experts   # 3 chunks


def test_replay_drives_the_routing(store, tiny_model):
    source = edgemoe.load(tiny_model("qwen3_moe", num_hidden_layers=4, num_experts=6, seed=5))
    records = trace_text(source, TEXT, context=64)
    config = BenchConfig(ram=expert_bytes(store), modes=("on-demand-lru",), prefill_tokens=(2,), decode_tokens=6,
                         warmup_tokens=0, repeats=1, replay=replay_of(records, store))
    (record,), _ = bench(store, config, bandwidths=FIXED)
    # Positions 0..7 take the trace's first tokens; trace layer i drives model layer i.
    routing = {}
    for r in records:
        if r.seq == 0:
            routing.setdefault(r.token, {})[r.layer] = r.experts
    def used(positions):
        return {(layer, e) for t in positions for layer in range(4) for e in routing[t][layer]}
    first_read_in_decode = used(range(8)) - used(range(2))
    assert first_read_in_decode   # the check below is not vacuous
    # The whole store fits in RAM: decode reads exactly the experts it uses that prefill did not.
    lengths = read_manifest(store).experts
    assert record["disk_bytes_per_token"] * 6 == sum(lengths[k].length for k in first_read_in_decode)


def test_predictive_mode_needs_a_routing_profile(tiny_model, tmp_path):
    out = tmp_path / "store"
    convert(tiny_model("mixtral"), out, bits=4)
    with pytest.raises(ValueError, match="has none: run `edgemoe profile"):
        bench(out, BenchConfig(ram=1 << 20, prefill_tokens=(4,)), bandwidths=FIXED)


def test_ram_budget_as_bytes_or_a_share_of_the_experts(store):
    assert parse_ram("25%", store) == int(0.25 * expert_bytes(store))
    assert parse_ram("1MiB", store) == 1 << 20
    assert parse_ram("0%", store) == 0   # streaming only, as --ram 0
    for bad in ("150%", "lots%", "-5%", "nan%", "inf"):
        with pytest.raises(ValueError, match="--ram"):
            parse_ram(bad, store)
    with pytest.raises(ValueError, match="--mode 'fast'"):
        BenchConfig(ram=1, modes=("fast",))


def test_ram_auto_sizes_each_run_as_edgemoe_run_would_for_the_runs_tokens(store, monkeypatch):
    """--ram auto: each store the bench opens sized when it opens by the loader's auto_ram, which
    reserves KV cache for the run's tokens (prompt, warm-up and timed steps)."""
    import edgemoe.loader
    assert parse_ram("auto", store) == "auto"
    contexts = []
    auto_ram = edgemoe.loader.auto_ram

    def counted(manifest, dtype, dense_bits, context, batch, **options):
        contexts.append(context)
        return auto_ram(manifest, dtype, dense_bits, context, batch, **options)
    monkeypatch.setattr(edgemoe.loader, "auto_ram", counted)
    config = BenchConfig(ram="auto", modes=("on-demand-lru", "predictive"), prefill_tokens=(20,), decode_tokens=4,
                         warmup_tokens=1, repeats=1)
    records, _ = bench(store, config, bandwidths=FIXED)
    assert contexts == [20 + 1 + 4] * 3      # the warm-up's model, then each mode's
    budget, _ = auto_ram(read_manifest(store), None, "auto", 25, 1)
    assert [r["ram_bytes"] for r in records] == [budget] * 2


def test_ram_auto_looks_again_in_the_bench_as_in_edgemoe_run(store, monkeypatch, tmp_path):
    """The bench decodes as `edgemoe run` does: a tier sized by auto (here a quarter of the experts,
    with fake memory facts that leave room) grows once it is full and was watched, and the record
    gives the tier's final size and when it grew."""
    import edgemoe.loader
    from edgemoe.ram_growth import GROWTH_WATCH_STEPS, RamGrowth
    from edgemoe.store.memory import MIB
    quarter = expert_bytes(store) // 4
    monkeypatch.setattr(edgemoe.loader, "auto_ram", lambda *args, **options: (quarter, {"available": 1 << 30}))
    proc, memory = tmp_path / "proc", tmp_path / "memory/sys/fs/cgroup/memory"
    proc.mkdir()
    (proc / "clear_refs").write_text("")
    (proc / "status").write_text("VmHWM: 4096 kB\nVmRSS: 4096 kB\n")
    memory.mkdir(parents=True)
    (tmp_path / "memory/proc/self").mkdir(parents=True)
    (tmp_path / "memory/proc/self/cgroup").write_text("5:memory:/\n")
    (memory / "memory.limit_in_bytes").write_text(str(1 << 30))
    (memory / "memory.usage_in_bytes").write_text(str((1 << 30) - 512 * MIB))
    for_store = RamGrowth.for_store.__func__
    monkeypatch.setattr(RamGrowth, "for_store", classmethod(
        lambda cls, s: for_store(cls, s, memory_root=str(tmp_path / "memory"), proc=str(proc))))
    config = BenchConfig(ram="auto", modes=("on-demand-lru",), prefill_tokens=(20,), decode_tokens=12,
                         warmup_tokens=1, repeats=1)
    (record,), _ = bench(store, config, bandwidths=FIXED)
    assert record["ram_grown_after_tokens"] >= GROWTH_WATCH_STEPS + 1
    assert record["ram_bytes"] == expert_bytes(store)      # 512 MiB of room: every expert


def test_bandwidths_are_measured(store):
    memory, detail = memory_bandwidth(nbytes=8 << 20, repeats=1)
    assert memory == max(detail.values()) > 0
    disk, detail = disk_bandwidth(store, sample_bytes=1 << 20)
    assert disk == max(detail["1_readers"], detail["2_readers"]) > 0


def test_confine_memory_writes_the_limit_and_this_process(tmp_path):
    root = tmp_path / "memory"
    with pytest.raises(ValueError, match="no cgroup v1 memory controller"):
        confine_memory("1GiB", root)
    root.mkdir()
    (root / "cgroup.procs").write_text("")
    group = confine_memory("1GiB", root)
    assert (group / "memory.limit_in_bytes").read_text() == str(1 << 30)
    assert (group / "cgroup.procs").read_text().strip().isdigit()


def test_leave_memory_group_moves_back_and_reports_the_peak(tmp_path, capsys):
    root = tmp_path / "memory"
    root.mkdir()
    (root / "cgroup.procs").write_text("")
    group = confine_memory("1GiB", root)
    (group / "memory.max_usage_in_bytes").write_text("123456")
    (group / "memory.failcnt").write_text("7")
    assert leave_memory_group(group) == (123456, 7)
    assert (root / "cgroup.procs").read_text() == str(os.getpid())
    # cgroupfs removes a group with its control files; a plain directory keeps them: named, not hidden
    assert f"could not remove {group}" in capsys.readouterr().err


def test_bench_command_prints_json_records(store, monkeypatch, capsys):
    monkeypatch.setattr("edgemoe.bench.measure_bandwidths", lambda path: FIXED)
    monkeypatch.setattr(sys, "argv", ["edgemoe", "bench", str(store), "--mode", "on-demand-lru", "--prefill", "6",
                                      "--decode-tokens", "2", "--repeats", "1", "--json", "--dense-bits", "8"])
    with pytest.raises(SystemExit) as exit_info:
        main()
    assert exit_info.value.code == 0
    (record,) = json.loads(capsys.readouterr().out)
    assert record["mode"] == "on-demand-lru" and record["prefill_tokens"] == 6 and record["dense_bits"] == 8
    assert record["ram_bytes"] == int(0.25 * expert_bytes(store))


def test_bench_command_names_a_bad_option(store, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["edgemoe", "bench", str(store), "--ram", "200%"])
    with pytest.raises(SystemExit) as exit_info:
        main()
    assert exit_info.value.code == 2
    assert "--ram '200%'" in capsys.readouterr().err


def test_bench_command_names_a_trace_that_does_not_fit(store, tmp_path, monkeypatch, capsys):
    trace = tmp_path / "wide.jsonl"
    write_trace(trace, [TraceRecord(0, 0, 0, [9, 1], [0.5, 0.5])])   # expert 9 of a 6-expert store
    monkeypatch.setattr(sys, "argv", ["edgemoe", "bench", str(store), "--replay", str(trace)])
    with pytest.raises(SystemExit) as exit_info:
        main()
    assert exit_info.value.code == 2
    assert f"{trace}: its routing" in capsys.readouterr().err


def test_default_prompt_lengths_fit_the_models_context():
    from edgemoe.bench import default_prefill
    assert default_prefill(32768, 36) == (512, 2048)
    assert default_prefill(1024, 36) == (512,)
    assert default_prefill(256, 36) == (128,)


def test_generated_routing_fits_the_model_and_profiles_another_text(store):
    from edgemoe.bench import generated_routing
    spec = read_manifest(store).spec
    replay, profile = generated_routing(spec, tokens=40)
    assert len(replay.stream) == 40 and set(replay.layer_of) == set(spec.moe_layer_ids)
    assert profile.moe_layers == list(spec.moe_layer_ids) and profile.num_experts == spec.num_experts
    config = BenchConfig(ram=expert_bytes(store) // 4, modes=("predictive",), prefill_tokens=(20,), decode_tokens=4,
                         warmup_tokens=1, repeats=1, replay=replay, routing_profile=profile)
    (record,), _ = bench(store, config, bandwidths=FIXED)
    assert record["mode"] == "predictive" and record["decode_tok_s"] > 0


def test_predictive_mode_takes_a_policy_or_predictor_in_place_of_the_defaults():
    """A breakdown of the default scheme's cost swaps one part of it; the other modes keep theirs."""
    from edgemoe.bench import store_options
    from edgemoe.loader import StoreOptions

    default = store_options("predictive", BenchConfig(ram=1 << 20))
    assert (default.policy, default.preload) == (StoreOptions().policy, StoreOptions().preload)
    swapped = store_options("predictive", BenchConfig(ram=1 << 20, policy="lru", preload="none"))
    assert (swapped.policy, swapped.preload) == ("lru", "none")
    assert store_options("on-demand-lru", BenchConfig(ram=1 << 20, policy="lfu")).policy == "lru"
