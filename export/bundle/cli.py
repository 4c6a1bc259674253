"""`edgespec bundle`: write a runtime bundle from HF checkpoint directories (and export it for more backends)."""
from __future__ import annotations

import argparse
import time

from runtime.errors import ConfigError

HELP = """Build a bundle from HF model directories (config.json + safetensors; Llama, Qwen2 or Qwen3).

The target's MTP module (DeepSeek-V3 keys at model.layers.N; or, for a target without one, the module
`edgespec train-drafter mtp` wrote, given with --mtp DIR) becomes the bundle's `mtp` drafter, a
--draft directory becomes its `draft_model` drafter, --medusa heads its `medusa` (tree) and `medusa_chain`
drafters, --eagle an EAGLE-1 head its `eagle` (chain) and `eagle2` (EAGLE-2 dynamic tree) drafters, --eagle3 an
EAGLE-3 head its `eagle3` (dynamic tree) and `eagle3_chain` drafters, and the n-gram drafter is always there.

The bundle carries the model's prompt format: its chat template (tokenizer_config.json or
chat_template.jinja), its special tokens and every EOS token (tokenizer_config.json, generation_config.json,
config.json), and edgespec's task templates (planner, action, text). A model with a chat template gets
edgespec's chat planner; the files below replace any part of it (README, "Your own model").

examples:
  edgespec bundle --target zoo/target --draft zoo/draft --medusa zoo/medusa --out build/bundles/zoo --backends numpy_ref,onnx
  edgespec bundle --target ~/models/Qwen3-0.6B --out build/bundles/qwen3
  edgespec bundle --target ~/models/Qwen3-0.6B --out build/bundles/qwen3 --planner-template planner.yaml
"""


BACKENDS = ("numpy_ref", "onnx")


def register(sub) -> None:
    p = sub.add_parser("bundle", help="build a bundle from HF checkpoint directories",
                       description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, metavar="DIR", help="HF directory of the target model")
    p.add_argument("--draft", metavar="DIR", help="HF directory of a separate draft model (same tokenizer)")
    p.add_argument("--medusa", metavar="PATH",
                   help="Medusa heads for the target: a Medusa-1 head file (medusa_lm_head.safetensors, or .pt read "
                        "with weights_only), its directory, or a Medusa-2 checkpoint (heads under medusa_head.); "
                        "adds the drafters medusa (a tree) and medusa_chain")
    p.add_argument("--eagle", metavar="DIR", help="an EAGLE-1 head (config.json + model.safetensors; official, vLLM "
                                                  "or speculators layout): drafters eagle and eagle2")
    p.add_argument("--mtp", metavar="DIR", help="an MTP module trained for a target that has none (`edgespec "
                   "train-drafter mtp`: model.safetensors with DeepSeek-V3 keys model.layers.N.*): the `mtp` drafter")
    p.add_argument("--eagle3", metavar="DIR", help="an EAGLE-3 head (same layouts): drafters eagle3 and eagle3_chain")
    p.add_argument("--dflash", action="append", default=[], metavar="DIR",
                   help="official DFlash or DFlash-2 drafter directory (z-lab layout); repeatable, one of each kind; "
                        "one drafter <kind>_b<size> more per smaller block in dflash_config.trained_block_sizes")
    p.add_argument("--out", required=True, metavar="DIR",
                   help="bundle directory to write: new or empty (an existing bundle is replaced only with "
                        "--force; a directory holding anything else is refused); never an input or inside one")
    p.add_argument("--force", action="store_true", help="replace the edgespec bundle already at --out")
    p.add_argument("--backends", default="numpy_ref", help="comma-separated: numpy_ref (always), onnx")
    p.add_argument("--default-drafter", help="drafter used when a request names none (default: draft_model if given)")
    g = p.add_argument_group("prompt format (default: the model's chat template and edgespec's task templates)")
    g.add_argument("--prompts", metavar="FILE", help="YAML with a `prompts:` section: planner / action / text "
                   "templates, eos_tokens (added to the model's), special_tokens, chat_template_kwargs")
    g.add_argument("--chat-template", metavar="FILE", help="Jinja chat template to use instead of the model's")
    g.add_argument("--planner-template", metavar="FILE", help="YAML planner template: {raw: TEXT} (the whole "
                   "prompt) or {system: TEXT, user: TEXT} (chat messages); may use {{ instruction }}, {{ context }}")
    g.add_argument("--action-template", metavar="FILE", help="YAML action template, as --planner-template; may use "
                   "{{ instruction }}, {{ observation }}")
    p.set_defaults(func=run)


def run(args) -> int:
    from export.bundle.builder import build_bundle, dtype_summary

    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    if not backends or any(b not in BACKENDS for b in backends):
        raise ConfigError(f"--backends: got {args.backends!r}, expected a comma-separated list of {list(BACKENDS)}")
    t0 = time.perf_counter()

    def add_backends(staged: str) -> None:
        print(f"bundle: wrote the numpy_ref bundle in {time.perf_counter() - t0:.1f} s")
        if args.eagle or args.eagle3:  # before the ONNX export, so that the graph outputs the taps they read
            from export.drafters.eagle import ZOO_TREE, add_eagle_to_bundle

            if args.eagle:
                add_eagle_to_bundle(staged, args.eagle, "eagle", drafters={"eagle": None, "eagle2": ZOO_TREE})
            if args.eagle3:
                add_eagle_to_bundle(staged, args.eagle3, "eagle3", drafters={"eagle3": ZOO_TREE, "eagle3_chain": None})
        if "onnx" in backends:
            from export.onnx.bundle import add_onnx_to_bundle

            t1 = time.perf_counter()
            files = add_onnx_to_bundle(staged, "fp32", None, validate=True)
            print(f"bundle: added {', '.join(files)} in {time.perf_counter() - t1:.1f} s")

    prompts = {"prompts_file": args.prompts, "chat_template_file": args.chat_template,
               "planner_file": args.planner_template, "action_file": args.action_template}
    out = build_bundle(args.target, args.out, args.draft, default_drafter=args.default_drafter, force=args.force,
                       extend=add_backends, prompts={k: v for k, v in prompts.items() if v}, report=print,
                       medusa=args.medusa, dflash_dirs=args.dflash, mtp_dir=args.mtp)
    print(f"bundle: {out} ready ({', '.join(sorted(set(backends) | {'numpy_ref'}))}); tensor dtypes as stored:")
    for line in dtype_summary(out):
        print(f"  {line}")
    return 0
