"""The docs point at things that exist: every relative link in README.md, BENCHMARKS.md and docs/ names a file or
folder of the repository (and, with `#anchor`, a heading of that page), every `edgespec` command they show parses, every `runtime/...`, `export/...`, `tests/...` or `scripts/...` path they name exists,
every `python -m` module they run can be found, and the README stays a page a newcomer reads in one sitting."""
from __future__ import annotations

import os
import re
from typing import Iterator, List, Tuple

import pytest

from tests.support import REPO_ROOT

README = os.path.join(REPO_ROOT, "README.md")
README_MAX_LINES = 200
LINE_MAX_CHARS = 160

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# A path starts at a word boundary (not inside `.cache/peers/...` or `onnx/export/...`) and stops before a
# placeholder such as `<name>`: the folder before the placeholder must exist.
PATH = re.compile(r"(?<![\w./-])((?:runtime|export|tests|scripts)/[\w./-]*)")
MODULE = re.compile(r"python3? -m ((?:runtime|export|edgespec_ros)(?:\.\w+)+)")


def doc_files() -> List[str]:
    files = [README, os.path.join(REPO_ROOT, "BENCHMARKS.md")]
    for root, _, names in os.walk(os.path.join(REPO_ROOT, "docs")):
        files += [os.path.join(root, n) for n in sorted(names) if n.endswith(".md")]
    return files


def rel(path: str) -> str:
    return os.path.relpath(path, REPO_ROOT)


def links(text: str) -> Iterator[Tuple[str, str]]:
    """(path, anchor) of each relative link; path "" = this page."""
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue  # a web address
        path, _, anchor = target.partition("#")
        yield path, anchor


def anchor_of(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens.
    Example: "Parameters (`configs/ros/edgespec.yaml`)" -> "parameters-configsrosedgespecyaml"."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: str) -> set:
    text = re.sub(r"```.*?```", "", open(path, encoding="utf-8").read(), flags=re.S)  # a `# comment` is no heading
    return {anchor_of(m) for m in re.findall(r"^#{1,6} (.+)$", text, re.M)}


def named_paths(text: str) -> Iterator[str]:
    for path in PATH.findall(text):
        path = path.rstrip(".,;:-")
        if "*" not in path:  # a glob (`tests/ros/*`) names files, not one path
            yield path


def module_file(module: str) -> str:
    """The file `python -m module` runs, or "" where there is none (edgespec_ros lives in ros2_ws)."""
    root = os.path.join(REPO_ROOT, "ros2_ws", "src", "edgespec_ros") if module.startswith("edgespec_ros") else REPO_ROOT
    base = os.path.join(root, *module.split("."))
    for candidate in (base + ".py", os.path.join(base, "__main__.py")):
        if os.path.isfile(candidate):
            return candidate
    return ""


def problems(files: List[str]) -> List[Tuple[str, str]]:
    found = []
    for f in files:
        text = open(f, encoding="utf-8").read()
        for target, anchor in links(text):
            dest = os.path.normpath(os.path.join(os.path.dirname(f), target)) if target else f
            if not os.path.exists(dest):
                found.append((rel(f), f"link {target}"))
            elif anchor and dest.endswith(".md") and anchor not in anchors(dest):
                found.append((rel(f), f"anchor {target}#{anchor}"))
        for path in named_paths(text):
            if not os.path.exists(os.path.join(REPO_ROOT, path)):
                found.append((rel(f), f"path {path}"))
        for module in MODULE.findall(text):
            if not module_file(module):
                found.append((rel(f), f"module {module}"))
    return found


COMMANDS = ("generate", "certify", "bench", "memory", "bundle", "export", "zoo", "train-drafter", "tune")


def edgespec_commands(text: str) -> Iterator[str]:
    """Each `edgespec <command> ...` the text names, inline or on a line of its own, continuations joined; a shell
    variable (`$k`) or a placeholder in brackets (`[--precision P]`, `<id>`, `...`) leaves a command out."""
    text = text.replace("\\\n", " ")
    found = re.findall(r"`((?:\.venv/bin/)?edgespec [^`]+)`", text)
    found += [line.strip() for line in text.splitlines() if re.match(r"\s*(\.venv/bin/)?edgespec ", line)]
    for cmd in found:
        for part in cmd.split("#")[0].split("&&"):
            words = part.split()
            if (len(words) > 1 and words[0].endswith("edgespec") and words[1] in COMMANDS
                    and not re.search(r"[$\[<|…]|\.\.\.", part)):
                yield " ".join(words)


def command_problem(cmd: str) -> str:
    """"" when argparse takes every flag and value of `cmd`; a command named in prose may leave out a required
    argument (`edgespec export --to onnx` stands for the export), but every flag it names must exist."""
    import contextlib
    import io
    import shlex

    from runtime.cli import build_parser

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            build_parser().parse_args(shlex.split(cmd)[1:])
    except SystemExit:
        last = err.getvalue().strip().splitlines()[-1]
        return "" if "the following arguments are required" in last else last
    return ""


def current_doc_files() -> List[str]:
    """The docs that describe today's code: the dated history keeps its commands as they were run."""
    return [f for f in doc_files() if os.sep + "history" + os.sep not in f]


def test_every_edgespec_command_in_the_current_docs_parses():
    bad = [(rel(f), cmd, why) for f in current_doc_files() for cmd in edgespec_commands(open(f).read())
           for why in [command_problem(cmd)] if why]
    assert bad == []


def test_the_command_check_catches_an_ambiguous_flag_and_skips_prose_and_placeholders():
    text = ("Run `edgespec zoo plans --n 200`; edgespec runs on robots; `edgespec memory plan [--json]`\n"
            "    edgespec bench --drafters none \\\n        --rounds 1\n")
    cmds = list(edgespec_commands(text))
    assert cmds == ["edgespec zoo plans --n 200", "edgespec bench --drafters none --rounds 1"]
    assert "ambiguous option" in command_problem(cmds[0]) and command_problem(cmds[1]) == ""


def test_every_link_path_and_module_named_in_the_docs_exists():
    assert problems(doc_files()) == []


def test_the_readme_is_at_most_200_lines_of_at_most_160_characters():
    lines = open(README, encoding="utf-8").read().splitlines()
    assert len(lines) <= README_MAX_LINES
    assert [i + 1 for i, line in enumerate(lines) if len(line) > LINE_MAX_CHARS] == []


def test_the_checker_reports_a_missing_link_anchor_path_and_module(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Top of (`the` page)\n[gone](nowhere.md) and [web](https://example.org) [here](#top-of-the-page) "
                    "[there](#no-such-heading); `runtime/no_such_file.py`, `runtime/drafters/<name>.py`, "
                    "`.cache/peers/runtime/x`; python -m runtime.no_such_module\n")
    found = problems([str(page)])
    kinds = sorted(what.split()[0] for _, what in found)
    assert kinds == ["anchor", "link", "module", "path"], found


@pytest.mark.parametrize("module", ["runtime.cli", "runtime.commands.bench_backend", "edgespec_ros.node"])
def test_the_modules_the_docs_run_resolve_to_files(module):
    assert module_file(module)
