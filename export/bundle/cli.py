"""`edgespec bundle`: write a runtime bundle from HF checkpoint directories (and export it for more backends)."""
from __future__ import annotations

import argparse
import time

from export.drafters import registry
from runtime.errors import ConfigError

HELP = """Build a bundle from HF model directories (config.json + safetensors; Llama, Qwen2 or Qwen3).

The target's MTP module (DeepSeek-V3 keys at model.layers.N; or, for a target without one, the module
`edgespec train-drafter mtp --target DIR --out DIR` wrote, given with --mtp DIR) becomes the bundle's `mtp` drafter, a
--draft directory becomes its `draft_model` drafter, --medusa heads its `medusa` (tree) and `medusa_chain`
drafters, --eagle an EAGLE-1 head its `eagle` (chain) and `eagle2` (EAGLE-2 dynamic tree) drafters, --eagle3 an
EAGLE-3 head its `eagle3` (dynamic tree) and `eagle3_chain` drafters, and the n-gram drafter is always there.

The bundle carries the model's prompt format: its chat template (tokenizer_config.json or
chat_template.jinja), its special tokens and every EOS token (tokenizer_config.json, generation_config.json,
config.json), and edgespec's task templates (planner, action, text). A model with a chat template gets
edgespec's chat planner; the files below replace any part of it (README, "Your own model").

To change a bundle later without rebuilding it (its ONNX / GGUF exports stay; only what the change touches is
exported): edgespec bundle add-drafter, remove-drafter and set-prompts (examples below; each has its -h).

examples:
  edgespec bundle --target zoo/target --draft zoo/draft --medusa zoo/medusa --out build/bundles/zoo --backends numpy_ref,onnx
  edgespec bundle --target ~/models/Qwen3-0.6B --out build/bundles/qwen3
  edgespec bundle --target ~/models/Qwen3-0.6B --out build/bundles/qwen3 --planner-template planner.yaml
  edgespec bundle add-drafter --bundle build/bundles/qwen3 --eagle3 ~/models/EAGLE3-Qwen3-0.6B
  edgespec bundle remove-drafter --bundle build/bundles/qwen3 eagle3 eagle3_chain
  edgespec bundle set-prompts --bundle build/bundles/qwen3 --planner-template planner.yaml
"""

EDIT_HELP = """Edits run on a hard-linked copy of the bundle beside it, which replaces the bundle once it loads with
every checksum right: a failed edit leaves the bundle as it was. Every file the edit does not touch keeps its bytes
and its mtime; nothing the manifest does not list is ever deleted."""


BACKENDS = ("numpy_ref", "onnx")


def register(sub) -> None:
    p = sub.add_parser("bundle", help="build a bundle from HF checkpoint directories (or edit one: add-drafter, "
                                      "remove-drafter, set-prompts)",
                       description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", metavar="DIR", help="HF directory of the target model (required to build)")
    registry.add_arguments(p)  # every drafter kind's flags (export/drafters/kinds/<name>.py)
    p.add_argument("--out", metavar="DIR",
                   help="bundle directory to write: new or empty (an existing bundle is replaced only with "
                        "--force; a directory holding anything else is refused); never an input or inside one")
    p.add_argument("--force", action="store_true", help="replace the edgespec bundle already at --out, exports and "
                                                         "all (to add a drafter or change prompts keeping them: "
                                                         "add-drafter, set-prompts)")
    p.add_argument("--backends", default="numpy_ref", help="comma-separated: numpy_ref (always), onnx")
    p.add_argument("--verbose", action="store_true",
                   help="also print the libraries' own logs and warnings during the ONNX export (hidden by default)")
    p.add_argument("--default-drafter", help="drafter used when a request names none (default: draft_model if given)")
    _prompt_args(p.add_argument_group("prompt format (default: the model's chat template and edgespec's task "
                                       "templates)"))
    p.set_defaults(func=run)
    edits = p.add_subparsers(dest="edit", metavar="{add-drafter,remove-drafter,set-prompts}",
                             title="edit an existing bundle (keeping its exports)")
    add = edits.add_parser("add-drafter", help="add drafters, exporting only their graphs",
                           description="Add drafters to a bundle, as `edgespec bundle` names them (each flag below "
                                       "says which drafters it adds). Only their graphs are exported: an "
                                       "ONNX graph per new head / draft model beside the kept target graph, a GGUF per "
                                       "quant for a draft model; the target graph is exported again only when a new "
                                       "drafter reads a hidden state it lacks. " + EDIT_HELP,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    add.add_argument("--bundle", required=True, metavar="DIR", help="the bundle to change")
    registry.add_arguments(add)
    add.add_argument("--no-validate", action="store_true",
                     help="skip the comparison of the new graphs against the numpy reference")
    add.set_defaults(func=run_add_drafter)
    rm = edits.add_parser("remove-drafter", help="remove drafters and the files only they use",
                          description="Remove drafters from a bundle, and the files the manifest lists for them that "
                                      "no other entry uses (eagle and eagle2 share theirs). " + EDIT_HELP,
                          formatter_class=argparse.RawDescriptionHelpFormatter)
    rm.add_argument("--bundle", required=True, metavar="DIR", help="the bundle to change")
    rm.add_argument("names", nargs="+", metavar="NAME", help="drafters to remove")
    rm.set_defaults(func=run_remove_drafter)
    sp = edits.add_parser("set-prompts", help="change the prompt format (no weight file changes)",
                          description="Lay prompt files over the bundle's prompt format (as `edgespec bundle` lays "
                                      "them over the model's) and record it; no weight or export is touched. "
                                      + EDIT_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    sp.add_argument("--bundle", required=True, metavar="DIR", help="the bundle to change")
    sp.add_argument("--target", metavar="DIR", help="start from this HF checkpoint's own prompt format instead of "
                                                    "the bundle's (the files below still apply)")
    _prompt_args(sp)
    sp.set_defaults(func=run_set_prompts)


def _prompt_args(g) -> None:
    g.add_argument("--prompts", metavar="FILE", help="YAML with a `prompts:` section: planner / action / text "
                   "templates, eos_tokens (added to the model's), special_tokens, chat_template_kwargs")
    g.add_argument("--chat-template", metavar="FILE", help="Jinja chat template to use instead of the model's")
    g.add_argument("--planner-template", metavar="FILE", help="YAML planner template: {raw: TEXT} (the whole "
                   "prompt) or {system: TEXT, user: TEXT} (chat messages); may use {{ instruction }}, {{ context }}")
    g.add_argument("--action-template", metavar="FILE", help="YAML action template, as --planner-template; may use "
                   "{{ instruction }}, {{ observation }}")


def _prompt_files(args) -> dict:
    return {"prompts_file": args.prompts, "chat_template_file": args.chat_template,
            "planner_file": args.planner_template, "action_file": args.action_template}


def run_add_drafter(args) -> int:
    from export.bundle.edit import add_drafters

    added = add_drafters(args.bundle, registry.given(args), validate=not args.no_validate)
    print(f"bundle: {args.bundle} ready; drafters added: {', '.join(added)}")
    return 0


def run_remove_drafter(args) -> int:
    from export.bundle.edit import remove_drafters

    remove_drafters(args.bundle, args.names)
    return 0


def run_set_prompts(args) -> int:
    from export.bundle.edit import set_prompts

    set_prompts(args.bundle, _prompt_files(args), target_dir=args.target)
    return 0


def run(args) -> int:
    from export.bundle.builder import build_bundle, dtype_summary
    from export.library_logs import set_verbose

    set_verbose(args.verbose)
    missing = [flag for flag, value in (("--target", args.target), ("--out", args.out)) if not value]
    if missing:
        raise ConfigError(f"{' and '.join(missing)} required to build a bundle (or edit one: "
                          "`edgespec bundle add-drafter --bundle DIR --eagle3 DIR`, remove-drafter, set-prompts)")

    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    if not backends or any(b not in BACKENDS for b in backends):
        raise ConfigError(f"--backends: got {args.backends!r}, expected a comma-separated list of {list(BACKENDS)}")
    t0 = time.perf_counter()

    def add_backends(staged: str) -> None:
        print(f"bundle: wrote the numpy_ref bundle in {time.perf_counter() - t0:.1f} s")
        if "onnx" in backends:
            from export.onnx.bundle import add_onnx_to_bundle

            t1 = time.perf_counter()
            files = add_onnx_to_bundle(staged, "fp32", None, validate=True)
            print(f"bundle: added {', '.join(files)} in {time.perf_counter() - t1:.1f} s")

    prompts = _prompt_files(args)
    out = build_bundle(args.target, args.out, default_drafter=args.default_drafter, force=args.force,
                       extend=add_backends, prompts={k: v for k, v in prompts.items() if v}, report=print,
                       drafters=registry.given(args))
    print(f"bundle: {out} ready ({', '.join(sorted(set(backends) | {'numpy_ref'}))}); tensor dtypes as stored:")
    for line in dtype_summary(out):
        print(f"  {line}")
    return 0
