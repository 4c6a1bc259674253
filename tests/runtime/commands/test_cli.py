"""Specification of the `edgespec` command line (runtime/commands/, export/*_cli.py): every flag meets the
typed checks its YAML key meets, a user's mistake is a one-line error (exit 2) and never a traceback,
every option says what it does, and every command a message suggests is one that runs."""
from __future__ import annotations

from tests.support import REPO_ROOT
import argparse
import ast
import glob
import json
import os
import re
import shlex

import numpy as np
import pytest

from runtime.cli import build_parser, main
from runtime.commands import common
from runtime.errors import BudgetExceeded, BundleError
from runtime.memory.kv import KVArena

ROOT = REPO_ROOT


def run_cli(argv, capsys):
    """(exit code, stdout, stderr) of `edgespec argv`, argparse's own exits included."""
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


# ---------------------------------------------------------------------------------------------- flags

BAD_FLAGS = [
    (["--max-context", "2000000"], "--max-context: memory.max_context: got 2000000, expected <= 1048576"),
    (["--max-context", "8"], "--max-context: memory.max_context: got 8, expected >= 16"),
    (["--branching", "0"], "--branching: drafter.branching: got 0, expected >= 1"),
    (["--branching", "-2"], "--branching: drafter.branching: got -2, expected >= 1"),
    (["--num-draft", "-3"], "--num-draft: drafter.num_tokens: got -3, expected >= 1"),
    (["--num-draft", "65"], "--num-draft: drafter.num_tokens: got 65, expected <= 64"),
    (["--top-p", "nan"], "--top-p: generation.top_p: got nan, expected a finite number"),
    (["--top-p", "-0.5"], "--top-p: generation.top_p: got -0.5, expected >= 1e-09"),
    (["--top-p", "1.5"], "--top-p: generation.top_p: got 1.5, expected <= 1.0"),
    (["--temperature", "inf"], "--temperature: generation.temperature: got inf, expected a finite number"),
    (["--temperature", "-1"], "--temperature: generation.temperature: got -1.0, expected >= 0.0"),
    (["--top-k", "-1"], "--top-k: generation.top_k: got -1, expected >= 0"),
    (["--seed", "-1"], "--seed: generation.seed: got -1, expected >= 0"),
    (["--max-tokens", "0"], "--max-tokens: generation.max_tokens: got 0, expected >= 1"),
]


@pytest.mark.parametrize("flags,message", BAD_FLAGS, ids=[" ".join(f) for f, _ in BAD_FLAGS])
def test_a_bad_generate_flag_is_refused_like_its_yaml_key_naming_flag_value_and_range(tiny_bundle, capsys, flags,
                                                                                       message):
    code, out, err = run_cli(["generate", "--prompt", "x", "--bundle", tiny_bundle] + flags, capsys)
    assert code == 2 and err == f"edgespec generate: error: {message}\n" and out == ""


@pytest.mark.parametrize("flags,message", [
    (["--domains", "foo"], "--domains: got 'foo', expected a comma-separated list of ['action', 'planner', 'text']"),
    (["--drafters", "none,telepathy"], "--drafters: got 'none,telepathy'; "),  # then what the bundle can run
    (["--repeats", "0"], "--rounds: got 0, expected >= 1"),
    (["--temperatures", "0,-1"], "--temperatures: got '0,-1', expected a comma-separated list of numbers"),
    (["--max-tokens", "0"], "--max-tokens: generation.max_tokens: got 0, expected >= 1"),
    (["--branching", "0"], "--branching: drafter.branching: got 0, expected >= 1"),
])
def test_a_bad_bench_flag_is_a_one_line_error_before_anything_runs(tiny_bundle, capsys, flags, message):
    code, out, err = run_cli(["bench", "--bundle", tiny_bundle] + flags, capsys)
    assert code == 2 and err.startswith(f"edgespec bench: error: {message}") and "Traceback" not in err
    assert out == ""


def test_a_flag_that_is_not_a_number_is_refused_by_argparse_with_usage(capsys):
    code, _, err = run_cli(["generate", "--prompt", "x", "--max-context", "1e9"], capsys)
    assert code == 2 and "argument --max-context: invalid int value: '1e9'" in err


def test_a_kv_arena_the_machine_cannot_hold_is_a_budget_error_not_a_numpy_traceback(monkeypatch):
    def no_memory(*args, **kwargs):
        raise MemoryError("Unable to allocate 7.5 TiB")

    monkeypatch.setattr(np, "zeros", no_memory)
    with pytest.raises(BudgetExceeded, match="cannot allocate .* GiB on this machine; lower max_context"):
        KVArena(1 << 40)


def test_flags_override_the_config_file_and_unset_ones_keep_it(tiny_bundle, tmp_path):
    cfg = tmp_path / "rt.yaml"
    cfg.write_text(f"bundle: {tiny_bundle}\ngeneration:\n  top_p: 0.5\n  max_tokens: 9\n")
    args = build_parser().parse_args(["generate", "--prompt", "x", "--config", str(cfg), "--top-p", "0.25"])
    got = common.runtime_config(args)
    assert got.generation.top_p == 0.25 and got.generation.max_tokens == 9 and got.bundle == tiny_bundle


# ---------------------------------------------------------------------------------------------- help, options

def subparser(name: str):
    parser = build_parser()
    return next(a for a in parser._actions if a.dest == "command").choices[name]


@pytest.mark.parametrize("command", ["generate", "bench", "bundle", "export"])
def test_every_option_says_what_it_does(command):
    missing = [a.option_strings[0] for a in subparser(command)._actions
               if a.option_strings and a.dest != "help" and not (a.help or "").strip()]
    assert not missing, f"edgespec {command}: options without help: {missing}"


def every_parser(parser, path=("edgespec",)):
    """(command path, parser) for the top level and every subcommand below it, depth first."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from every_parser(sub, path + (name,))


def test_every_command_and_subcommand_prints_its_help():
    # a bare % in a help string ("~7 % of the target") made `edgespec zoo standin --help` a traceback
    for path, parser in every_parser(build_parser()):
        assert "usage:" in parser.format_help(), " ".join(path)


def test_the_top_level_help_lists_every_drafter_kind_train_drafter_trains(capsys):
    from export.drafters.cli import KINDS
    code, out, _ = run_cli(["--help"], capsys)
    text = " ".join(out.split())  # argparse wraps the command list
    assert code == 0 and f"train-drafter distil a drafter ({', '.join(KINDS)})" in text, text


@pytest.mark.parametrize("command", ["plan", "profile"])
def test_memory_subcommands_have_a_description_and_examples_that_parse(command):
    memory = subparser("memory")
    sub = next(a for a in memory._actions if a.dest == "memory_command").choices[command]
    text = sub.format_help()
    assert "examples:" in text and len(sub.description.split("examples:")[0].split()) > 20, text
    examples = sub.description.split("examples:")[1].replace("\\\n", " ")  # continuation lines joined
    lines = [l.strip() for l in examples.splitlines() if l.strip().startswith(f"edgespec memory {command}")]
    assert lines, text
    for line in lines:
        build_parser().parse_args(shlex.split(line)[1:])


def test_bench_has_one_drafter_option_and_the_singular_still_works():
    opts = {o for a in subparser("bench")._actions for o in a.option_strings}
    assert "--drafters" in opts and "--drafter" not in opts
    args = build_parser().parse_args(["bench", "--drafter", "ngram"])  # a prefix of --drafters
    assert args.drafters == "ngram"


def test_generate_plan_stream_prints_the_plan_text(tiny_bundle, capsys):
    base = ["generate", "--plan", "pick up the red cup", "--bundle", tiny_bundle, "--max-tokens", "12"]
    code, out, _ = run_cli(base + ["--json"], capsys)
    text = json.loads(out)["text"]
    code, out, _ = run_cli(base + ["--stream"], capsys)
    assert code == 0 and text and out.startswith(text + "\n-- plan: ")


# ---------------------------------------------------------------------------------------------- the default bundle

def test_the_default_bundle_is_found_from_the_edgespec_root_whatever_the_working_directory(tiny_bundle, tmp_path,
                                                                                           monkeypatch):
    root = tmp_path / "root"
    os.makedirs(root / "build" / "bundles")
    os.symlink(tiny_bundle, root / "build" / "bundles" / "zoo")
    monkeypatch.setenv("EDGESPEC_ROOT", str(root))
    monkeypatch.chdir(tmp_path)
    args = build_parser().parse_args(["generate", "--prompt", "x"])
    assert common.runtime_config(args).bundle == str(root / "build" / "bundles" / "zoo")


def test_a_missing_default_bundle_says_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGESPEC_ROOT", str(tmp_path))
    args = build_parser().parse_args(["generate", "--prompt", "x"])
    with pytest.raises(BundleError) as exc:
        common.runtime_config(args)
    msg = str(exc.value)
    assert msg.startswith(f"{tmp_path}/build/bundles/zoo: no bundle there") and "$EDGESPEC_ROOT" in msg
    assert "`make bundles`" in msg and "--bundle DIR" in msg


def test_without_edgespec_root_the_default_bundle_is_under_the_source_tree(monkeypatch):
    monkeypatch.delenv("EDGESPEC_ROOT", raising=False)
    assert common.edgespec_root() == ROOT


def test_a_relative_bundle_flag_is_relative_to_the_working_directory(tiny_bundle, monkeypatch):
    monkeypatch.chdir(os.path.dirname(tiny_bundle))
    args = build_parser().parse_args(["generate", "--prompt", "x", "--bundle", os.path.basename(tiny_bundle)])
    assert common.runtime_config(args).bundle == tiny_bundle


# ---------------------------------------------------------------------------------------------- suggested commands

def _message_strings(path: str):
    """The text of every string passed to an exception or print() in a source file; f-string holes -> 'X'."""
    tree = ast.parse(open(path).read(), path)
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = getattr(node.func, "id", getattr(node.func, "attr", ""))
        if not (name == "print" or name.endswith(("Error", "Exceeded", "Exit"))):
            continue
        for arg in ast.walk(node):
            if isinstance(arg, ast.JoinedStr):
                yield "".join(v.value if isinstance(v, ast.Constant) else "X" for v in arg.values)
            elif isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                yield arg.value
    for node in ast.walk(tree):  # module-level message constants (e.g. REBUILD_BUNDLE)
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str) \
                and any(isinstance(t, ast.Name) and t.id.isupper() for t in node.targets):
            yield node.value.value


SOURCES = sorted(glob.glob(os.path.join(ROOT, "runtime", "**", "*.py"), recursive=True)
                 + glob.glob(os.path.join(ROOT, "export", "**", "*.py"), recursive=True))
MAKE_TARGETS = set(re.findall(r"^([\w-]+):", open(os.path.join(ROOT, "Makefile")).read(), re.M))


def test_every_command_a_message_suggests_exists_and_its_arguments_parse():
    """`edgespec export --to tensorrt` (refused by argparse) or "re-run `edgespec export`" for a bundle
    that export cannot open are what this forbids: each suggestion must be a command line that runs."""
    parser = build_parser()
    seen = 0
    for path in SOURCES:
        for text in _message_strings(path):
            for cmd in re.findall(r"`((?:edgespec|make) [^`]*)`", text):
                seen += 1
                where = f"{os.path.relpath(path, ROOT)}: `{cmd}`"
                words = shlex.split(cmd)
                if words[0] == "make":
                    assert set(words[1:]) <= MAKE_TARGETS, where
                    continue
                try:
                    parser.parse_args(words[1:])
                except SystemExit:
                    pytest.fail(f"{where} does not parse as an edgespec command")
    assert seen >= 8
