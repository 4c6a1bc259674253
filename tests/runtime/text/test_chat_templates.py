"""Specification of a bundle's prompt format (runtime/text/templates.py, export/bundle/prompts.py): one's own model end to end.

Tiny random Qwen3-style and Llama-3-style checkpoints with chat templates in the style of the real ones
(tests/support/chat_checkpoints.py: system / user / assistant roles, generation prompt) are bundled by the real export path; the planner prompt the runtime renders (jinja2
sandbox, no transformers) must tokenize to exactly what transformers' apply_chat_template gives."""
from __future__ import annotations

from tests.support import REPO_ROOT
import os
import re
import shlex
import shutil

import pytest
import transformers
import yaml

from export.bundle.builder import build_bundle
from runtime.model import bundle as bundle_io
from runtime.model.bundle import MANIFEST
from runtime.errors import BundleError
from runtime.text.prompts import ZOO_PROMPTS, planner_request
from runtime.serving.session import GenerationParams, Session
from runtime.text.templates import PromptFormat, task_template
from tests.support.chat_checkpoints import LLAMA3_TEMPLATE, save_checkpoint

INSTRUCTION = "bring me the red cup from the kitchen"
CONTEXT = 'failed {"skill":"pick","object":"red cup"}: not found'


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("chat"))
    return {family: save_checkpoint(root, family) for family in ("qwen3", "llama3")}


def write_yaml(path, d) -> str:
    with open(path, "w") as f:
        yaml.safe_dump(d, f)
    return str(path)


def hf_ids(checkpoint: str, messages, **kwargs):
    tok = transformers.PreTrainedTokenizerFast.from_pretrained(checkpoint)
    out = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kwargs)
    return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)


# ---------------------------------------------------------------------------------------------- token identity

@pytest.mark.parametrize("family", ["qwen3", "llama3"])
@pytest.mark.parametrize("context", ["", CONTEXT])
def test_the_planner_prompt_tokens_equal_transformers_apply_chat_template(checkpoints, tmp_path, family, context):
    kwargs = {"enable_thinking": False} if family == "qwen3" else {}
    prompts = write_yaml(tmp_path / "prompts.yaml", {"prompts": {"chat_template_kwargs": kwargs}}) if kwargs else None
    out = build_bundle(checkpoints[family], str(tmp_path / "b"), prompts={"prompts_file": prompts} if prompts else None)
    s = Session.open(out, drafter="none")
    try:
        messages = s.prompts.messages("planner", instruction=INSTRUCTION, context=context)
        assert [m["role"] for m in messages] == ["system", "user"]
        ours = s.tokenizer.encode_prompt(planner_request(INSTRUCTION, context, s.prompts))  # what Session.plan prefills
        assert ours == hf_ids(checkpoints[family], messages, **kwargs)
        text = s.tokenizer.decode(ours)
        assert text.endswith("<think>\n\n</think>\n\n" if family == "qwen3"
                             else "<|start_header_id|>assistant<|end_header_id|>\n\n")
        assert ("What happened so far" in text) == bool(context) and (not context or context in text)
        res = s.plan(INSTRUCTION, context, GenerationParams(max_tokens=4))  # the request path runs on it
        assert res.stats.tokens <= 4
    finally:
        s.close()


def test_a_chat_template_sees_the_special_tokens_and_renders_the_llama3_bos(checkpoints, tmp_path):
    out = build_bundle(checkpoints["llama3"], str(tmp_path / "b"))
    b = bundle_io.load(out)
    assert b.prompts.special_tokens["bos_token"] == "<|begin_of_text|>"
    assert b.prompts.render("planner", instruction="x", context="").startswith("<|begin_of_text|><|start_header_id|>")
    assert b.prompts.render("text", text="hello") == "<|begin_of_text|>hello"
    with open(os.path.join(out, "chat_template.jinja")) as f:  # a checksummed file of the bundle
        assert f.read() == LLAMA3_TEMPLATE


# ---------------------------------------------------------------------------------------------- EOS list

def test_every_eos_token_of_the_model_is_recorded_and_ends_generation(checkpoints, tmp_path):
    out = build_bundle(checkpoints["llama3"], str(tmp_path / "b"))
    b = bundle_io.load(out)
    # tokenizer_config's eos_token first, then generation_config's list, then config.json's id
    assert b.prompts.eos_tokens == ("<|eot_id|>", "<|end_of_text|>", "<|eom_id|>")
    s = Session.open(out, drafter="none")
    try:
        assert s.engine.eos == {s.tokenizer.token_to_id(t) for t in b.prompts.eos_tokens}
    finally:
        s.close()


def test_generation_stops_at_whichever_eos_token_of_the_list_comes_first(checkpoints, tmp_path):
    """Stand-in stop tokens taken from the model's own greedy output (a random model emits no real EOS): with
    the list [a, b] in bundle.yaml, greedy output is the plain output cut before the first of a or b."""
    out = build_bundle(checkpoints["qwen3"], str(tmp_path / "b"))
    params = GenerationParams(max_tokens=24)
    s = Session.open(out, drafter="none")
    try:
        s.engine.eos = set()
        plain = s.generate_ids(s.tokenizer.encode("the robot"), params)[1]
        names = [s.tokenizer.id_to_token(t) for t in plain]
    finally:
        s.close()
    first_new = list(dict.fromkeys(plain))
    a, b = first_new[2], first_new[4]  # two distinct tokens; b first appears after a
    for stop in ([names[plain.index(a)], names[plain.index(b)]], [names[plain.index(b)]]):
        m = yaml.safe_load(open(os.path.join(out, MANIFEST)))
        m["prompts"]["eos_tokens"] = stop
        write_yaml(os.path.join(out, MANIFEST), m)
        for drafter in ("none", "ngram"):
            s = Session.open(out, drafter=drafter)
            try:
                _, tokens, finish, _ = s.generate_ids(s.tokenizer.encode("the robot"), params)
            finally:
                s.close()
            cut = min(plain.index(s.tokenizer.token_to_id(t)) for t in stop)
            assert (tokens, finish) == (plain[:cut], "eos"), (stop, drafter)


# ---------------------------------------------------------------------------------------------- defaults and errors

def test_the_zoo_bundle_records_todays_zoo_prompts_exactly(tmp_path):
    out = build_bundle("zoo/target", str(tmp_path / "zoo"))
    b = bundle_io.load(out)
    assert b.prompts == PromptFormat.from_dict(ZOO_PROMPTS.to_dict(), b.prompts.source)
    assert b.prompts.render("planner", instruction="bring me the red cup", context="") == \
        "<|bos|><|plan|>bring me the red cup<|sep|>"
    assert b.prompts.render("planner", instruction="go", context="failed: x") == "<|bos|><|plan|>go<|ctx|>failed: x<|sep|>"
    assert b.prompts.render("action", instruction="lift", observation="+0.10") == "<|bos|><|act|>lift<|obs|>+0.10<|sep|>"
    assert b.prompts.render("text", text="To be") == "<|bos|><|text|>To be"


def test_a_bundle_from_before_prompts_were_recorded_gets_the_zoo_format(tiny_bundle, tmp_path):
    root = str(tmp_path / "old")
    shutil.copytree(tiny_bundle, root)
    m = yaml.safe_load(open(os.path.join(root, MANIFEST)))
    del m["prompts"]
    write_yaml(os.path.join(root, MANIFEST), m)
    s = Session.open(root, drafter="none")
    try:
        assert s.prompts is ZOO_PROMPTS and s.engine.eos == {2}
    finally:
        s.close()


def test_a_base_model_without_a_chat_template_bundles_and_a_plan_says_what_to_add(checkpoints, tmp_path):
    base = str(tmp_path / "base")
    shutil.copytree(checkpoints["qwen3"], base)
    os.remove(os.path.join(base, "chat_template.jinja"))
    out = build_bundle(base, str(tmp_path / "b"))
    s = Session.open(out, drafter="none")
    try:
        with pytest.raises(BundleError, match=r"no planner template.*--planner-template FILE"):
            s.plan(INSTRUCTION)
    finally:
        s.close()
    planner = write_yaml(tmp_path / "planner.yaml", {"raw": "Task: {{ instruction }}\nPlan:"})
    out = build_bundle(base, str(tmp_path / "b2"), prompts={"planner_file": planner})
    b = bundle_io.load(out)
    assert b.prompts.render("planner", instruction="go", context="") == "Task: go\nPlan:"


def test_a_planner_template_file_replaces_the_default_chat_planner(checkpoints, tmp_path):
    planner = write_yaml(tmp_path / "planner.yaml", {"system": "You are a planner.",
                                                     "user": "{{ instruction }}{% if context %} ({{ context }}){% endif %}"})
    out = build_bundle(checkpoints["qwen3"], str(tmp_path / "b"), prompts={"planner_file": planner})
    text = bundle_io.load(out).prompts.render("planner", instruction="go", context="x")
    assert text == "<|im_start|>system\nYou are a planner.<|im_end|>\n<|im_start|>user\ngo (x)<|im_end|>\n" \
                   "<|im_start|>assistant\n"


@pytest.mark.parametrize("template, match", [
    ({"user": "{{ instructon }}"}, r"--planner-template .*\.user: uses 'instructon'.*may use \['instruction', 'context'\]"),
    ({"raw": "{% if %}"}, r"--planner-template .*\.raw: not a valid Jinja template \(line 1"),
    ({"raw": "a", "user": "b"}, r"either `raw:`.*not both"),
    ({"system": "s"}, r"either `raw:`.*not neither"),
    ({"prompt": "x"}, r"\.prompt: unknown key"),
])
def test_a_bad_template_file_is_refused_at_bundle_time_naming_the_file_and_key(checkpoints, tmp_path, template, match):
    planner = write_yaml(tmp_path / "planner.yaml", template)
    with pytest.raises(BundleError, match=match):
        build_bundle(checkpoints["qwen3"], str(tmp_path / "b"), prompts={"planner_file": planner})
    assert not os.path.exists(tmp_path / "b")


def test_a_template_the_chat_template_refuses_fails_at_bundle_time(checkpoints, tmp_path):
    """Llama-3's template raises on a second system message: found by `edgespec bundle`, not on the robot."""
    bad = write_yaml(tmp_path / "p.yaml", {"prompts": {"chat_template": LLAMA3_TEMPLATE.replace(
        "messages[0]['role'] == 'system'", "false")}})
    with pytest.raises(BundleError, match=r"planner template cannot be rendered.*Only user and assistant roles"):
        build_bundle(checkpoints["llama3"], str(tmp_path / "b"), prompts={"prompts_file": bad})


def _unknown_key(p):
    p["stop"] = ["x"]


def _bad_syntax(p):
    p["planner"] = {"raw": "{{ instruction"}


def _unknown_variable(p):
    p["action"] = {"raw": "{{ instruction }} {{ obs }}"}


def _chat_without_template(p):
    del p["chat_template"]


def _eos_not_a_list(p):
    p["eos_tokens"] = "<|im_end|>"


@pytest.mark.parametrize("mutate, match", [
    (_unknown_key, r"prompts\.stop: unknown key"),
    (_bad_syntax, r"prompts\.planner\.raw: not a valid Jinja template"),
    (_unknown_variable, r"prompts\.action\.raw: uses 'obs'"),
    (_chat_without_template, r"prompts\.planner: has system/user messages but the bundle has no chat_template"),
    (_eos_not_a_list, r"prompts\.eos_tokens: got '<\|im_end\|>', expected a list"),
])
def test_a_malformed_prompts_section_is_refused_at_load_naming_the_key(checkpoints, tmp_path, mutate, match):
    out = build_bundle(checkpoints["qwen3"], str(tmp_path / "b"))
    m = yaml.safe_load(open(os.path.join(out, MANIFEST)))
    mutate(m["prompts"])
    write_yaml(os.path.join(out, MANIFEST), m)
    with pytest.raises(BundleError, match=match):
        bundle_io.load(out)


def test_an_eos_token_the_tokenizer_lacks_is_refused_naming_it(checkpoints, tmp_path):
    extra = write_yaml(tmp_path / "p.yaml", {"prompts": {"eos_tokens": ["<|im_stop|>"]}})
    with pytest.raises(BundleError, match=r"eos_tokens: '<\|im_stop\|>' is not a token"):
        build_bundle(checkpoints["qwen3"], str(tmp_path / "b"), prompts={"prompts_file": extra})


def test_a_chat_template_cannot_reach_python_internals(checkpoints, tmp_path):
    """The sandbox HF uses: a template from the Hub is untrusted code."""
    evil = write_yaml(tmp_path / "p.yaml", {"prompts": {
        "chat_template": "{{ messages.__class__.__mro__[1].__subclasses__() }}"}})
    with pytest.raises(BundleError, match=r"cannot be rendered.*(unsafe|access)"):
        build_bundle(checkpoints["qwen3"], str(tmp_path / "b"), prompts={"prompts_file": evil})


# ---------------------------------------------------------------------------------------------- README

def test_every_command_of_the_readme_own_model_section_parses_and_its_files_are_valid():
    from runtime.cli import build_parser

    root = REPO_ROOT
    readme = open(os.path.join(root, "README.md")).read()
    section = readme.split("## Your own model", 1)[1].split("\n## ", 1)[0]
    commands = [line.strip() for line in section.replace("\\\n", " ").splitlines() if line.startswith("edgespec ")]
    assert {c.split()[1] for c in commands} >= {"bundle", "export", "memory", "generate", "certify"}
    parser = build_parser()
    for cmd in commands:
        try:
            parser.parse_args(shlex.split(cmd)[1:])
        except SystemExit:
            pytest.fail(f"README: `{cmd}` does not parse as an edgespec command")
    for rel in set(re.findall(r"configs/prompts/[\w.-]+\.yaml", section)):
        d = yaml.safe_load(open(os.path.join(root, rel)))
        if "prompts" in d:
            PromptFormat.from_dict(d["prompts"], rel, partial=True)
        else:
            task_template(d, "planner", rel)
    node = next(line for line in section.replace("\\\n", " ").splitlines() if "edgespec_ros.node" in line)
    assert os.path.isfile(os.path.join(root, node.split("--params-file ")[1].split()[0]))


# ---------------------------------------------------------------------------------------------- bench, certify

def test_bench_and_certify_start_from_the_bundles_own_prompts(checkpoints, tmp_path, capsys):
    from runtime.cli import main
    from runtime.commands.bench import bench_prompts
    from runtime.commands.certify import seeds

    out = build_bundle(checkpoints["qwen3"], str(tmp_path / "b"))
    fmt = bundle_io.load(out).prompts
    planner = [text for domain, text in seeds(fmt) if domain == "planner"]
    assert len(planner) == 6 and all(t.startswith("<|im_start|>system\n") for t in planner)
    assert bench_prompts(fmt)["text"][0] == "To be, or not to be"  # Qwen3 has no BOS
    assert main(["bench", "--bundle", out, "--drafters", "none,ngram", "--max-tokens", "4", "--rounds", "1",
                 "--json"]) == 0  # 0: greedy output identical to plain decoding, on the chat prompts
    base = str(tmp_path / "base")
    shutil.copytree(checkpoints["qwen3"], base)
    os.remove(os.path.join(base, "chat_template.jinja"))
    out = build_bundle(base, str(tmp_path / "b2"))
    assert [d for d, _ in seeds(bundle_io.load(out).prompts)] == ["text"]  # only what the bundle has templates for
    capsys.readouterr()
    assert main(["bench", "--bundle", out, "--domains", "planner", "--drafters", "none", "--rounds", "1"]) == 2
    assert "no planner template" in capsys.readouterr().err
