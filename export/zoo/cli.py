"""`edgespec zoo build|report|standin|plans`: build the embedded default models, measure their quality, widen the
target into the memory-bound stand-in, or measure plan validity with and without the plan schema."""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

# `zoo standin --robot`: a robot model's proportions (BENCHMARKS.md, "The robot-proportioned stand-in"). The SwiGLU
# width is not the vocabulary size (3072): onnxruntime-genai's builder takes every Linear with vocab_size outputs
# for the LM head (builders/base.py has_lm_head), so a 3072-wide MLP made its peer model's logits garbage.
ROBOT = {"depth": 24, "hidden": 512, "intermediate": 3200, "kv_heads": 8, "draft_hidden": 384, "draft_intermediate": 3328}


def _build(args) -> int:
    from export.zoo.train import DEFAULT_OUT, build

    out = args.out
    if out is None:
        out = tempfile.mkdtemp(prefix="edgespec-zoo-quick-") if args.quick else DEFAULT_OUT
    if args.quick and os.path.abspath(out) == os.path.abspath(DEFAULT_OUT):
        print("edgespec zoo build: --quick never writes over the shipped zoo; pick another --out", file=sys.stderr)
        return 2
    cmd = "edgespec zoo build" + (" --quick" if args.quick else "")
    build(out, quick=args.quick, resume=args.resume, command=cmd)
    if not args.no_report:
        from export.zoo.report import quality_report
        from export.zoo.train import FULL, QUICK

        quality_report(out, n=(QUICK if args.quick else FULL).report_examples)
    print(f"zoo written to {out}")
    return 0


def _report(args) -> int:
    from export.zoo.report import quality_report
    from export.zoo.train import DEFAULT_OUT

    quality_report(args.zoo or DEFAULT_OUT, n=args.n, write=not args.no_write)
    return 0


def _standin(args) -> int:
    import time

    from export.zoo.standin import add_standin_dflash, add_standin_eagle_heads, write_standin
    from export.zoo.train import DEFAULT_OUT

    zoo = args.zoo or DEFAULT_OUT
    t0 = time.perf_counter()
    if args.bundle:  # refuse the bundle's directory before minutes of writing the stand-in, not after
        from export.bundle.builder import check_output

        check_output(args.bundle, [zoo, args.out], args.force, flag="--bundle")
    if args.robot:  # a robot model's proportions (BENCHMARKS.md, "The stand-in"): deep, ~0.5 GB fp32, a 7 % draft
        args.depth = args.depth or ROBOT["depth"]
        args.hidden, args.intermediate, args.kv_heads = ROBOT["hidden"], ROBOT["intermediate"], ROBOT["kv_heads"]
        args.draft_hidden = args.draft_hidden or ROBOT["draft_hidden"]
        args.draft_intermediate = args.draft_intermediate or ROBOT["draft_intermediate"]
    params = write_standin(os.path.join(zoo, "target"), args.out, args.hidden, args.intermediate, args.kv_heads,
                           args.depth)
    print(f"standin: {args.out}: {params / 1e6:.1f} M params ({4 * params / 1e6:.0f} MB fp32), "
          f"written in {time.perf_counter() - t0:.1f} s")
    layers = None
    if args.depth:
        from export.zoo.standin import layer_map

        with open(os.path.join(zoo, "target", "config.json")) as f:
            layers = (layer_map(json.load(f)["num_hidden_layers"], args.depth), args.depth)
    draft = os.path.join(zoo, "draft")
    if args.draft_hidden:  # the draft model padded too, to a real draft's share of the target's bytes
        draft_out = os.path.join(args.out, "draft")
        d_params = write_standin(draft, draft_out, args.draft_hidden, args.draft_intermediate or 4 * args.draft_hidden,
                                 args.draft_kv_heads, heads=False)
        draft = draft_out
        print(f"standin: draft {draft_out}: {d_params / 1e6:.1f} M params, {100 * d_params / params:.1f} % of the "
              "target's")
    if args.bundle:
        from export.bundle.builder import build_bundle
        from export.onnx.bundle import add_onnx_to_bundle

        name = os.path.basename(os.path.normpath(os.path.abspath(args.bundle)))
        name = name if "standin" in name else name + "-standin"  # `edgespec bench` labels rows by this name

        def add_onnx(staged: str) -> None:
            add_standin_eagle_heads(zoo, args.out, staged, args.hidden, args.intermediate, args.kv_heads, layers)
            add_standin_dflash(zoo, args.out, staged, args.hidden, args.intermediate, args.kv_heads, layers)
            if not args.no_onnx:
                files = add_onnx_to_bundle(staged, "fp32", None, validate=True)
                print(f"standin: added {', '.join(files)} ({time.perf_counter() - t0:.0f} s)")

        medusa = os.path.join(args.out, "medusa")  # the zoo's Medusa heads, widened by write_standin
        build_bundle(args.out, args.bundle, draft, name=name, force=args.force,
                     extend=add_onnx, medusa=medusa if os.path.isdir(medusa) else None, flag="--bundle")
        print(f"standin: bundle {args.bundle} (name {name}) ready in {time.perf_counter() - t0:.0f} s")
    return 0


def _plans(args) -> int:
    from export.zoo.plans import run

    return run(args)


def register(sub) -> None:
    p = sub.add_parser("zoo", help="build or report on the embedded default models (the zoo)",
                       description="The zoo: a small Llama target with a DeepSeek-V3 MTP module and a distilled "
                                   "draft model, trained here on generated robot-planner / action-token data and "
                                   "Shakespeare. Shipped in zoo/ (fp16, HF checkpoint dirs).")
    zsub = p.add_subparsers(dest="zoo_command", metavar="<build|report|standin|plans>")
    zsub.required = True
    b = zsub.add_parser("build", help="generate data, train tokenizer, target (+MTP) and draft; write the zoo",
                        description="Runs the whole pipeline on the CPU (about 55 minutes; --quick: the same "
                                    "pipeline at toy scale in under 3 minutes). Data, tokenizer, initialisation and "
                                    "batch order are fixed by the seed; each training stage stops at a step count or "
                                    "a wall-clock budget, whichever comes first (MANIFEST.yaml records the steps "
                                    "run). Progress lines show step, loss, tokens/s and ETA; checkpoints go to "
                                    "<out>/_work every few minutes.")
    b.add_argument("--quick", action="store_true", help="toy scale (tiny models, few steps); writes to a temp dir "
                                                        "unless --out is given, never over the shipped zoo")
    b.add_argument("--out", default=None, help="output directory (default: the repo's zoo/, or a temp dir with --quick)")
    b.add_argument("--resume", action="store_true", help="continue an interrupted build from <out>/_work checkpoints")
    b.add_argument("--no-report", action="store_true", help="skip the quality report at the end")
    b.set_defaults(func=_build)
    r = zsub.add_parser("report", help="held-out losses and output quality of a built zoo",
                        description="Greedy-decodes held-out planner instructions (share of valid JSON plans whose "
                                    "objects match the instruction) and action prompts (share decoding to in-range "
                                    "actions); MTP and draft top-1 agreement with the target; per-domain held-out "
                                    "losses. Writes the numbers into MANIFEST.yaml.")
    r.add_argument("--zoo", default=None, help="zoo directory (default: the repo's zoo/)")
    r.add_argument("-n", type=int, default=200, help="held-out examples per domain to greedy-decode (default 200)")
    r.add_argument("--no-write", action="store_true", help="print only; leave MANIFEST.yaml unchanged")
    r.set_defaults(func=_report)
    s = zsub.add_parser("standin", help="widen the zoo target into a memory-bound stand-in that predicts the same",
                        description="Pads the zoo target (and its MTP module) with zero-contribution weights so a "
                                    "forward streams the bytes of a ~125 M-parameter model (hidden 1024, SwiGLU 4096, "
                                    "32 query / 8 KV heads: ~500 MB fp32) while its logits stay the zoo target's "
                                    "(norm weights and eps rescaled to the new width). Writes an HF checkpoint to "
                                    "--out and, with --bundle, a bundle (zoo/draft as its draft model, ONNX graphs "
                                    "added) whose name contains 'standin', so benchmarks label it. "
                                    "Example: edgespec zoo standin --out build/standin --bundle build/bundles/zoo-standin")
    s.add_argument("--out", required=True, help="directory for the widened HF checkpoint")
    s.add_argument("--zoo", default=None, help="zoo directory holding target/ and draft/ (default: the repo's zoo/)")
    s.add_argument("--hidden", type=int, default=1024, help="new hidden size, a multiple of head_dim (default 1024)")
    s.add_argument("--intermediate", type=int, default=4096, help="new SwiGLU intermediate size (default 4096)")
    s.add_argument("--kv-heads", type=int, default=8, help="new KV heads; query heads are hidden / head_dim (default 8)")
    s.add_argument("--depth", type=int, default=None,
                   help="layers of the stand-in (>= the zoo's 8): the zoo's layers spread evenly, zero-contribution "
                        "layers between, drafter taps renamed to land on the real ones (default: the zoo's depth)")
    s.add_argument("--draft-hidden", type=int, default=None, help="pad the zoo draft model to this hidden size too")
    s.add_argument("--draft-intermediate", type=int, default=None, help="... and this SwiGLU size (default 4 x hidden)")
    s.add_argument("--draft-kv-heads", type=int, default=6, help="... and these KV heads (default 6)")
    s.add_argument("--robot", action="store_true",
                   help="a robot model's proportions: depth 24, hidden 512, SwiGLU 3200, 8 KV heads (~145 M params, "
                        "0.58 GB fp32) and the draft model padded to hidden 384 / SwiGLU 3328 (~7 %% of the target)")
    s.add_argument("--bundle", default=None, help="also build a bundle here from --out and the zoo draft")
    s.add_argument("--no-onnx", action="store_true", help="with --bundle: numpy_ref only, no ONNX graphs")
    s.add_argument("--force", action="store_true", help="replace the edgespec bundle already at --bundle")
    s.set_defaults(func=_standin)
    from runtime.commands.common import add_model_args

    pl = zsub.add_parser("plans", help="valid / exact plan rates, tau and speedup with and without the plan schema",
                         description="Greedy-decodes the held-out planner prompts and 20 hand-written out-of-"
                                     "distribution instructions under plain and speculative decoding, each free and "
                                     "constrained by configs/plan_schema.json, interleaved in one process; prints "
                                     "valid-plan rate (parses and validates against the schema), exact-plan rate, "
                                     "tau, tokens/s, paired speedup and the grammar's share of decode time. "
                                     "Example: edgespec zoo plans --n 200 --drafter draft_model")
    add_model_args(pl)
    pl.add_argument("--zoo", default=None, help="zoo directory whose MANIFEST fixes the held-out split (default: zoo/)")
    pl.add_argument("-n", type=int, default=200, help="held-out planner prompts (default 200)")
    pl.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    pl.set_defaults(func=_plans)
