"""`edgespec zoo build|report`: build the embedded default models, or measure their quality."""
from __future__ import annotations

import argparse
import os
import sys
import tempfile


def _build(args) -> int:
    from export.zoo.train import DEFAULT_OUT, build

    out = args.out
    if out is None:
        out = tempfile.mkdtemp(prefix="edgespec-zoo-quick-") if args.quick else DEFAULT_OUT
    if args.quick and os.path.abspath(out) == os.path.abspath(DEFAULT_OUT):
        print("edgespec zoo build: --quick never writes over the shipped zoo; pick another --out", file=sys.stderr)
        return 2
    cmd = "edgespec zoo build" + (" --quick" if args.quick else "")
    build(out, quick=args.quick, resume=args.resume, command=cmd, run_report=not args.no_report)
    print(f"zoo written to {out}")
    return 0


def _report(args) -> int:
    from export.zoo.report import quality_report
    from export.zoo.train import DEFAULT_OUT

    quality_report(args.zoo or DEFAULT_OUT, n=args.n, write=not args.no_write)
    return 0


def register(sub) -> None:
    p = sub.add_parser("zoo", help="build or report on the embedded default models (the zoo)",
                       description="The zoo: a small Llama target with a DeepSeek-V3 MTP module and a distilled "
                                   "draft model, trained here on generated robot-planner / action-token data and "
                                   "Shakespeare. Shipped in zoo/ (fp16, HF checkpoint dirs).")
    zsub = p.add_subparsers(dest="zoo_command", metavar="<build|report>")
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
