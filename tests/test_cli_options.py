"""Every command's options with bad values: exit status 2 and one line on stderr naming the flag, and
nothing written or replaced. Checked where the value enters, before any model is loaded where the
value alone is wrong; after loading where it depends on the model (a window past its context)."""

import json
import os
import sys

import pytest

from edgemoe.convert import convert
from helpers import run_cli


@pytest.fixture(scope="module")
def paths(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("options")
    checkpoint = tiny_model("mixtral", max_position_embeddings=64)
    store = root / "store"
    convert(checkpoint, store, bits=4)
    text = root / "text.txt"
    text.write_text("To be, or not to be, that is the question. " * 20)
    binary = root / "trace.bin"
    binary.write_bytes(bytes(range(256)) * 4)
    trace = root / "trace.jsonl"
    trace.write_text("".join(json.dumps({"seq": 0, "token": t, "layer": 0, "experts": [t % 4, (t + 1) % 4],
                                         "weights": [0.6, 0.4]}) + "\n" for t in range(8)))
    return {"CKPT": str(checkpoint), "STORE": str(store), "TEXT": str(text), "BIN": str(binary),
            "OUT": str(root / "new-store"), "TRACE": str(trace), "NOWHERE": str(root / "nowhere.txt")}


BAD = [
    # run
    (["run", "CKPT", "--temperature", "nan"], "--temperature"),
    (["run", "CKPT", "--temperature", "-1"], "--temperature"),
    (["run", "CKPT", "--temperature", "abc"], "--temperature"),
    (["run", "CKPT", "--top-p", "0"], "--top-p"),
    (["run", "CKPT", "--top-p", "1.5"], "--top-p"),
    (["run", "CKPT", "--top-k", "-1"], "--top-k"),
    (["run", "CKPT", "-n", "-3"], "--max-new-tokens"),
    (["run", "STORE", "--ram", "inf"], "--ram"),
    (["run", "STORE", "--ram", "-5"], "--ram"),
    (["run", "STORE", "--ram", "lots"], "--ram"),
    (["run", "STORE", "--ram", "150%"], "--ram"),
    (["run", "STORE", "--vram", "nan"], "--vram"),
    (["run", "STORE", "--vram", "1MiB", "--device", "nonsense"], "--device"),
    (["run", "STORE", "--policy", "bogus"], "--policy"),
    (["run", "STORE", "--preload", "bogus"], "--preload"),
    (["run", "STORE", "--skip-below", "1.5"], "--skip-below"),
    (["run", "CKPT", "--skip-below", "0.2"], "--skip-below"),          # a checkpoint reads no experts
    (["run", "CKPT", "--ram", "25%"], "--ram"),           # a checkpoint has no store to budget
    (["run", "CKPT", "--dtype", "int3"], "--dtype"),
    (["run", "CKPT", "--threads", "0"], "--threads"),
    (["run", "CKPT", "--threads", "999"], "--threads"),   # past the kernels' thread pool
    (["run", "STORE", "--vram", "1MiB"], "--vram"),        # no GPU here, no --device: the library's check
    (["run", "STORE", "--replay", "BIN"], "trace.bin"),
    (["run", "CKPT", "--bogus"], "--bogus"),
    (["run", "CKPT", "--beams", "0"], "--beams"),
    (["run", "CKPT", "--beams", "two"], "--beams"),
    (["run", "CKPT", "--beams", "2", "--temperature", "0.7"], "--temperature"),   # beams do not sample
    (["run", "CKPT", "--beams", "2", "--top-k", "5"], "--top-k"),
    (["run", "CKPT", "--beams", "2", "--top-p", "0.9"], "--top-p"),
    (["run", "CKPT", "--beams", "2", "--seed", "1"], "--seed"),
    (["run", "CKPT", "--beams", "2", "--stop", "x"], "--stop"),
    (["run", "CKPT", "--beams", "2", "--length-penalty", "nan"], "--length-penalty"),
    (["run", "CKPT", "--length-penalty", "0.5"], "--length-penalty"),            # only with --beams
    (["run", "CKPT", "--early-stopping"], "--early-stopping"),
    (["run", "CKPT", "--seed", "1"], "--seed"),          # the checkpoint's generation_config decodes greedily
    (["chat", "CKPT", "--top-k", "5"], "--top-k"),
    # convert
    (["convert", "CKPT", "-o", "OUT", "--bits", "3"], "--bits"),
    (["convert", "CKPT", "-o", "OUT", "--fallback-bits", "8"], "--fallback-bits"),
    (["convert", "CKPT", "-o", "OUT", "--bits", "2", "--fallback-bits", "2"], "--fallback-bits"),   # the library's
    (["convert", "CKPT", "-o", "OUT", "--budget", "200%"], "--budget"),
    (["convert", "CKPT", "-o", "OUT", "--budget", "nan"], "--budget"),
    (["convert", "CKPT", "-o", "OUT", "--budget", "-1%"], "--budget"),
    (["convert", "CKPT", "-o", "OUT", "--metric", "bleu"], "--metric"),
    (["convert", "CKPT", "-o", "OUT", "--method", "gptq"], "--method"),
    (["convert", "CKPT", "-o", "OUT", "--compress", "gzip"], "--compress"),
    (["convert", "CKPT", "-o", "OUT", "--group-size", "0"], "--group-size"),
    (["convert", "CKPT", "-o", "OUT", "--workers", "0"], "--workers"),
    (["convert", "CKPT", "-o", "OUT", "--confidence", "1.5"], "--confidence"),
    (["convert", "CKPT", "-o", "OUT", "--calib-tokens", "1"], "--calib-tokens"),
    (["convert", "CKPT", "-o", "OUT", "--search-minutes", "-1"], "--search-minutes"),
    (["convert", "CKPT", "-o", "OUT", "--search-minutes", "inf"], "--search-minutes"),
    (["convert", "CKPT", "-o", "CKPT", "--force"], "is the input"),
    (["convert", "CKPT", "-o", "OUT", "--calib", "NOWHERE"], "nowhere.txt"),   # read before any work
    # eval
    (["eval", "CKPT", "--text", "TEXT", "--context", "0"], "--context"),
    (["eval", "CKPT", "--text", "TEXT", "--context", "600"], "--context"),   # past the model's 64
    (["eval", "CKPT", "--text", "TEXT", "--stride", "0"], "--stride"),
    (["eval", "CKPT", "--text", "TEXT", "--context", "32", "--stride", "40"], "--stride"),
    (["eval", "CKPT", "--text", "TEXT", "--ram", "1GiB"], "--ram"),
    (["eval", "STORE", "--text", "TEXT", "--ram", "lots"], "--ram"),
    (["eval", "STORE", "--text", "TEXT", "--fallback-below", "1"], "--fallback-below"),
    (["run", "STORE", "--fallback-below", "0.3"], "--fallback-below"),     # the store has no copies
    # trace, profile, inspect
    (["trace", "CKPT", "--text", "TEXT", "-o", "OUT", "--context", "1"], "--context"),
    (["trace", "CKPT", "--text", "TEXT", "-o", "OUT", "--context", "65"], "--context"),
    (["profile", "STORE", "--text", "TEXT", "--min-count", "0"], "--min-count"),
    (["profile", "STORE", "--text", "TEXT", "--context", "100"], "--context"),
    (["profile", "CKPT", "--text", "TEXT"], "not a store"),
    (["profile", "STORE", "--trace", "BIN"], "trace.bin"),
    (["inspect", "STORE", "--ram", "lots"], "--ram"),
    # serve, chat
    (["serve", "CKPT", "--port", "70000"], "--port"),
    (["serve", "CKPT", "--max-batch", "0"], "--max-batch"),
    (["serve", "CKPT", "--max-connections", "0"], "--max-connections"),
    (["serve", "CKPT", "--request-timeout", "0"], "--request-timeout"),
    (["serve", "CKPT", "--keep-alive-timeout", "nan"], "--keep-alive-timeout"),
    (["serve", "CKPT", "--ram", "1GiB"], "--ram"),
    (["chat", "CKPT", "--temperature", "nan"], "--temperature"),
    (["chat", "CKPT", "-n", "0"], "--max-new-tokens"),
    # bench
    (["bench", "STORE", "--ram", "abc"], "--ram"),
    (["bench", "STORE", "--mode", "fast"], "--mode"),
    (["bench", "STORE", "--prefill", "0"], "--prefill"),
    (["bench", "STORE", "--prefill", "60"], "--prefill"),   # 60 + 36 decode steps > 64
    (["bench", "STORE", "--repeats", "0"], "--repeats"),
    (["bench", "STORE", "--decode-tokens", "0"], "--decode-tokens"),
    (["bench", "STORE", "--warmup-tokens", "-1"], "--warmup-tokens"),
    (["bench", "STORE", "--memory-limit", "lots"], "--memory-limit"),
    (["bench", "STORE", "--compute", "gpu"], "--compute"),
    (["bench", "STORE", "--skip-below", "1"], "--skip-below"),
    (["bench", "STORE", "--fallback-below", "-0.1"], "--fallback-below"),
    (["eval", "STORE", "--text", "TEXT", "--compute", "fused"], "--compute"),
    (["eval", "STORE", "--text", "TEXT", "--compute", "device"], "--compute"),   # no VRAM tier: the library's
    (["run", "STORE", "--preload", "correlation"], "--preload"),                 # the store has no profile
    # simulate
    (["simulate", "TRACE", "--cache-experts", "0"], "--cache-experts"),
    (["simulate", "TRACE", "--cache-experts", "4", "--policy", "fifo"], "--policy"),
    (["simulate", "TRACE", "--cache-experts", "4", "--min-probability", "2"], "--min-probability"),
    (["simulate", "TRACE", "--cache-experts", "4", "--tokens", "0"], "--tokens"),
    (["simulate", "BIN", "--cache-experts", "4"], "trace.bin"),
]


@pytest.mark.parametrize("args, flag", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_values_exit_2_with_one_line_naming_the_flag(monkeypatch, capsys, paths, args, flag):
    code, err = run_cli(monkeypatch, capsys, *[paths.get(a, a) for a in args])
    assert code == 2, err
    assert err.count("\n") == 0 and err.startswith("error: ") and flag in err, err
    assert "----" not in err and "Traceback" not in err
    assert not os.path.exists(paths["OUT"])


def test_a_config_that_is_not_an_object_or_has_a_fractional_count_is_named(monkeypatch, capsys, tiny_model,
                                                                            tmp_path):
    import shutil
    checkpoint = tmp_path / "ckpt"
    shutil.copytree(tiny_model("mixtral"), checkpoint)
    config = json.loads((checkpoint / "config.json").read_text())
    for bad, message in (([config], "expected a JSON object"), ({**config, "num_local_experts": 8.5},
                                                                 "num_local_experts=8.5: expected an integer")):
        (checkpoint / "config.json").write_text(json.dumps(bad))
        code, err = run_cli(monkeypatch, capsys, "run", str(checkpoint), "-p", "x")
        assert code == 2 and err.count("\n") == 0 and "config.json" in err and message in err, err


def test_no_progress_output_off_a_terminal_and_convert_reports_its_whole_time(paths, tmp_path):
    import subprocess
    out = subprocess.run([sys.executable, "-m", "edgemoe", "eval", paths["CKPT"], "--text", paths["TEXT"]],
                         capture_output=True, text=True)
    assert out.returncode == 0 and out.stderr == "" and "perplexity:" in out.stdout
    made = subprocess.run([sys.executable, "-m", "edgemoe", "convert", paths["CKPT"], "-o", str(tmp_path / "s"),
                           "--calib", paths["TEXT"]], capture_output=True, text=True)
    assert made.returncode == 0 and made.stderr == "" and " s in all" in made.stdout


# ---- every option with a checked value, given a bad one, is named (generated from the commands) ----
COMMAND_ARGS = {"run": ["STORE"], "eval": ["STORE", "--text", "TEXT"], "serve": ["STORE"], "chat": ["STORE"],
                "convert": ["CKPT", "-o", "OUT"], "inspect": ["STORE"], "trace": ["STORE", "--text", "TEXT", "-o", "OUT"],
                "profile": ["STORE", "--text", "TEXT"], "bench": ["STORE"], "simulate": ["TRACE", "--cache-experts", "4"]}
BAD_BY_TYPE = {int: "-7", float: "nan", str: "no-such-value"}
ANY_TEXT = {"--stop"}   # every text is a valid stop string


def checked_options():
    """(command, flag, bad value) for every option whose value a check sees: a typer callback, or a
    store flag (checked by StoreOptions); the bad value chosen by the option's type."""
    import typing
    from inspect import signature

    import typer

    from edgemoe.cli import app
    from edgemoe.commands.options import STORE_FLAGS

    for command in app.registered_commands:
        name = command.name or command.callback.__name__
        hints = typing.get_type_hints(command.callback)
        for parameter in signature(command.callback).parameters.values():
            option = parameter.default
            if not isinstance(option, typer.models.OptionInfo) or not (option.callback or parameter.name in STORE_FLAGS):
                continue
            flag = max(option.param_decls or ["--" + parameter.name.replace("_", "-")], key=len)
            base = [t for t in typing.get_args(hints[parameter.name]) if t is not type(None)] or [hints[parameter.name]]
            base = typing.get_args(base[0])[0] if typing.get_origin(base[0]) in (list, typing.List) else base[0]
            if flag not in ANY_TEXT:
                yield name, flag, BAD_BY_TYPE[base]
    yield "run", "--threads", "999999"   # an upper bound too


CHECKED = list(checked_options())


def test_the_generated_options_cover_every_command():
    assert {command for command, _, _ in CHECKED} == set(COMMAND_ARGS)
    assert len(CHECKED) > 50


@pytest.mark.parametrize("command, flag, value", CHECKED, ids=[f"{c} {f} {v}" for c, f, v in CHECKED])
def test_every_checked_option_names_its_flag(monkeypatch, capsys, paths, command, flag, value):
    args = [command, *[paths.get(a, a) for a in COMMAND_ARGS[command]], flag, value]
    code, err = run_cli(monkeypatch, capsys, *args)
    assert code == 2 and err.count("\n") == 0 and err.startswith(f"error: {flag} "), err


# ---- a flag several commands take is one option, the same on each (edgemoe/commands/options.py) ----
STORE_FLAGS = ("--ram", "--vram", "--device", "--policy", "--preload", "--skip-below", "--fallback-below", "--compute")
STORE_COMMANDS = ("run", "eval", "serve", "chat")      # those that load a model with the store options
COMPUTING_COMMANDS = ("run", "eval", "convert", "trace", "profile", "bench", "serve", "chat")
LOADING_COMMANDS = ("run", "eval", "bench", "serve", "chat")   # those that load a model to run it
LOAD_FLAGS = ("--dtype", "--dense-bits", "--kv-dtype")
SHARED_FLAGS = (*STORE_FLAGS, *LOAD_FLAGS, "--threads", "--temperature", "--top-k", "--top-p", "--seed")
OWN_MEANING = {("bench", "--ram"): "a capacity every mode runs with, 25% by default, no auto",
               ("inspect", "--ram"): "the capacity placement is shown for, none by default",
               ("simulate", "--policy"): "the policies to compare, repeatable"}


def declared_flags() -> dict:
    """{command: {flag: what its declaration says (default, help, type, repeatable, checked)}}, as the
    command line parses them."""
    import typer.main

    from edgemoe.cli import app

    return {name: {max(p.opts, key=len): (p.default, p.help, p.type_descriptor.annotation, p.multiple,
                                           p.callback is not None)
                   for p in command.params if p.opts[0].startswith("-")}
            for name, command in typer.main.get_command(app).commands.items()}


def test_every_command_that_takes_the_store_options_takes_all_of_them():
    flags = declared_flags()
    assert {command: [f for f in STORE_FLAGS if f not in flags[command]] for command in STORE_COMMANDS} == \
        {command: [] for command in STORE_COMMANDS}


def test_every_command_that_loads_a_model_takes_every_load_flag():
    flags = declared_flags()
    assert {command: [f for f in LOAD_FLAGS if f not in flags[command]] for command in LOADING_COMMANDS} == \
        {command: [] for command in LOADING_COMMANDS}


def test_every_command_that_computes_takes_threads():
    flags = declared_flags()
    assert [command for command in COMPUTING_COMMANDS if "--threads" not in flags[command]] == []


def test_a_shared_flag_is_declared_alike_on_every_command_that_takes_it():
    """Its default, help, type and check are the same wherever it is given (bench's --skip-below is
    run's --skip-below), but for the few flags that mean something else on one command."""
    by_flag = {}
    for command, flags in declared_flags().items():
        for flag, declaration in flags.items():
            if flag in SHARED_FLAGS and (command, flag) not in OWN_MEANING:
                by_flag.setdefault(flag, {}).setdefault(declaration, []).append(command)
    assert {flag: list(declarations.values()) for flag, declarations in by_flag.items() if len(declarations) > 1} == {}


def test_the_store_flags_new_to_serve_chat_and_run_act(monkeypatch, capsys, paths):
    """serve and chat now take --skip-below, --fallback-below and --compute, run --compute, and pass
    them to the model: each is refused for the library's reason where it cannot act, as on eval."""
    cases = [(command, args, flag, reason) for command in ("serve", "chat") for args, flag, reason in (
        (["CKPT", "--skip-below", "0.2"], "--skip-below", "applies to stores"),
        (["STORE", "--fallback-below", "0.3"], "--fallback-below", "has no fallback copies"),
        (["STORE", "--compute", "device"], "--compute", "needs a VRAM tier"))]
    cases.append(("run", ["STORE", "--compute", "device"], "--compute", "needs a VRAM tier"))
    for command, args, flag, reason in cases:
        code, err = run_cli(monkeypatch, capsys, command, *[paths.get(a, a) for a in args])
        assert code == 2 and err.count("\n") == 0 and flag in err and reason in err, (command, err)


# ---- options that cannot act where they are given are refused (edgemoe.commands.cannot_act.CANNOT_ACT) ----
CANNOT_ACT_EXAMPLES = {
    ("run", "temperature"): [["CKPT", "--beams", "2", "--temperature", "0.7"]],
    ("run", "top_k"): [["CKPT", "--beams", "2", "--top-k", "5"], ["CKPT", "--temperature", "0", "--top-k", "5"]],
    ("run", "top_p"): [["CKPT", "--beams", "2", "--top-p", "0.9"], ["CKPT", "--temperature", "0", "--top-p", "0.9"]],
    ("run", "seed"): [["CKPT", "--beams", "2", "--seed", "1"], ["CKPT", "--temperature", "0", "--seed", "1"]],
    ("run", "stop"): [["CKPT", "--beams", "2", "--stop", "x"]],
    ("chat", "top_k"): [["CKPT", "--temperature", "0", "--top-k", "5"]],
    ("chat", "top_p"): [["CKPT", "--temperature", "0", "--top-p", "0.5"]],
    ("chat", "seed"): [["CKPT", "--temperature", "0", "--seed", "3"]],
    ("run", "length_penalty"): [["CKPT", "--length-penalty", "0.5"]],
    ("run", "early_stopping"): [["CKPT", "--early-stopping"]],
    ("run", "speculate"): [["CKPT", "--speculate", "3"]],
    ("run", "draft_ram"): [["CKPT", "--draft-ram", "1MiB"], ["CKPT", "--draft", "CKPT", "--draft-ram", "1MiB"]],
    ("run", "draft"): [["CKPT", "--draft", "self", "--beams", "2"], ["CKPT", "--draft", "self", "--replay", "TRACE"]],
    **{(c, "device"): [[*COMMAND_ARGS[c], "--device", "cpu"]] for c in ("run", "eval", "serve", "chat")},
    ("bench", "skip_below"): [["STORE", "--mode", "on-demand-lru", "--skip-below", "0.2"]],
    ("bench", "fallback_below"): [["STORE", "--mode", "all-in-ram", "--fallback-below", "0.2"]],
    ("bench", "routing"): [["STORE", "--replay", "TRACE", "--routing", "model"]],
    ("bench", "ram"): [["STORE", "--mode", "all-in-ram", "--ram", "10%"]],
    ("convert", "metric"): [["CKPT", "-o", "OUT", "--metric", "kl"]],
    ("convert", "heldout"): [["CKPT", "-o", "OUT", "--heldout", "TEXT"]],
    ("convert", "calib_tokens"): [["CKPT", "-o", "OUT", "--calib-tokens", "100"]],
    ("convert", "confidence"): [["CKPT", "-o", "OUT", "--confidence", "0.9"]],
    ("convert", "importance"): [["CKPT", "-o", "OUT", "--importance", "exact"]],
    ("convert", "search_minutes"): [["CKPT", "-o", "OUT", "--search-minutes", "5"]],
    ("convert", "bits"): [["CKPT", "-o", "OUT", "--bits", "8", "--budget", "5%", "--calib", "TEXT"]],
    ("profile", "context"): [["STORE", "--trace", "TRACE", "--context", "16"]],
    ("profile", "threads"): [["STORE", "--trace", "TRACE", "--threads", "1"]],
}


def _cannot_act_cases():
    from edgemoe.commands.cannot_act import CANNOT_ACT

    return sorted({(command, rule.option) for rule in CANNOT_ACT for command in rule.commands})


@pytest.mark.parametrize("command, option", _cannot_act_cases())
def test_each_option_that_cannot_act_is_refused_naming_it_and_why(monkeypatch, capsys, paths, command, option):
    """Every (command, option) of the table has examples, and each example of a rule is refused with
    the flag and the rule's reason; together they give every reason the table has for that option."""
    from edgemoe.commands.cannot_act import CANNOT_ACT

    reasons = {rule.why for rule in CANNOT_ACT if command in rule.commands and rule.option == option}
    flag = "--" + option.replace("_", "-")
    seen = set()
    for example in CANNOT_ACT_EXAMPLES[command, option]:
        code, err = run_cli(monkeypatch, capsys, command, *[paths.get(a, a) for a in example])
        assert code == 2 and err.count("\n") == 0 and err.startswith(f"error: {flag}"), err
        seen |= {why for why in reasons if why in err}
    assert seen == reasons
    assert not os.path.exists(paths["OUT"])


def test_eval_skips_weak_misses_without_decode_being_asked(monkeypatch, capsys, paths):
    """--skip-below acts per step on misses every token of the step chose weakly: eval implies --decode
    for it (scoring whole windows skipped 72 expert choices here against decoding's 798, and gave
    another perplexity than generation would see)."""
    def eval_json(*extra):
        monkeypatch.setattr(sys, "argv", ["edgemoe", "eval", paths["STORE"], "--text", paths["TEXT"],
                                          "--context", "32", "--ram", "0", "--preload", "none", "--threads", "1",
                                          "--compute", "fused-float", "--json", *extra])
        capsys.readouterr()
        with pytest.raises(SystemExit) as done:
            from edgemoe.cli import main
            main()
        assert done.value.code == 0
        return json.loads(capsys.readouterr().out)

    implied = eval_json("--skip-below", "0.45")
    assert implied["skipped_per_token"] > 0
    asked = eval_json("--skip-below", "0.45", "--decode")
    assert (implied["nll"], implied["skipped_per_token"]) == (asked["nll"], asked["skipped_per_token"])
