"""`edgespec generate`: one request, printed with its speculative statistics."""
from __future__ import annotations

import argparse
import json
import sys

from runtime.commands.common import add_model_args, add_sampling_args, generation_params, runtime_config
from runtime.errors import RequestError
from runtime.text.grammar import load_schema_file, read_text_file
from runtime.serving.session import Session

HELP = """Generate text from a bundle and print the speculative-decoding statistics.

examples:
  edgespec generate --prompt "<|bos|><|plan|>bring the red cup to the kitchen<|sep|>"
  edgespec generate --plan "bring the red cup to the kitchen" --drafter ngram
  edgespec generate --prompt "<|bos|><|text|>To be" --temperature 0.8 --seed 3 --json
  edgespec generate --plan "bring the red cup to the kitchen" --schema configs/plan_schema.json
  edgespec generate --prompt "<|bos|><|text|>Yes or no?" --grammar answer.lark

--schema / --grammar constrain the answer (llguidance): every token is drawn from the target masked by
the grammar, also inside speculative decoding, so a plan always parses unless --max-tokens cuts it.
"""


def register(sub) -> None:
    p = sub.add_parser("generate", help="generate text and print tau, tokens/s and time split",
                       description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="raw prompt text (special tokens such as <|bos|> are recognised)")
    src.add_argument("--plan", metavar="INSTRUCTION",
                     help="a planner instruction, put in the bundle's planner template (bundle.yaml prompts.planner)")
    add_model_args(p)
    add_sampling_args(p)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--schema", metavar="FILE", help="JSON Schema file the answer must satisfy (the zoo's plans: "
                                                    "configs/plan_schema.json)")
    g.add_argument("--grammar", metavar="FILE", help="Lark grammar file (llguidance dialect) the answer must match")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("--stream", action="store_true", help="print text as it is accepted (--prompt and --plan)")
    p.set_defaults(func=run)


def run(args) -> int:
    cfg = runtime_config(args)
    params = generation_params(cfg)
    schema = load_schema_file(args.schema) if args.schema else None
    lark = read_text_file(args.grammar, "grammar") if args.grammar else None
    session = Session(cfg)
    on_delta = (lambda d, n: (sys.stdout.write(d), sys.stdout.flush())) if args.stream and not args.json else None
    if args.plan is not None:
        if lark is not None:
            raise RequestError("grammar", "--plan takes a JSON Schema (--schema); use --prompt with --grammar")
        res = session.plan(args.plan, params=params, on_delta=on_delta, schema=schema)
        record = {"text": res.text, "plan_ok": res.plan_ok, "plan_error": res.plan_error,
                  "finish_reason": res.finish_reason, "stats": res.stats.to_dict()}
    else:
        res = session.generate(args.prompt, params, on_delta=on_delta, json_schema=schema, grammar=lark)
        record = {"text": res.text, "token_ids": res.token_ids, "finish_reason": res.finish_reason,
                  "stats": res.stats.to_dict()}
    if args.json:
        print(json.dumps(record))
        return 0
    if on_delta is None:
        print(record["text"])
    else:
        print()
    if args.plan is not None:
        print(f"-- plan: {'valid' if res.plan_ok else 'INVALID: ' + res.plan_error}")
    s = res.stats
    shape = s.shape if s.drafter == "none" or s.shape == "fixed" else (
        f"{s.shape}, mean budget {s.mean_budget:.1f} nodes, {s.mean_nodes:.1f} drafted, {s.skipped_cycles} of "
        f"{s.cycles} cycles drafted nothing")
    print(f"-- {s.tokens} tokens, finish={res.finish_reason}, drafter={s.drafter}, backend={s.backend}, shape={shape}")
    print(f"-- tau={s.tau:.2f} tokens/verify, target forwards={s.target_forwards}, {s.tokens_per_s:.1f} tokens/s, "
          f"ttft={s.ttft_s * 1e3:.1f} ms ({s.prefill_tokens} prompt tokens prefilled, {s.prefix_tokens} kept by the "
          f"prefix cache)")
    print(f"-- time: prefill {s.prefill_s * 1e3:.1f} ms, draft {s.draft_s * 1e3:.1f} ms, verify {s.verify_s * 1e3:.1f} ms, "
          f"other {s.other_s * 1e3:.1f} ms; acceptance by depth {[round(a, 2) for a in s.acceptance_by_depth]}")
    if schema is not None or lark is not None:
        print(f"-- grammar: {s.grammar_s * 1e3:.1f} ms computing masks ({100 * s.grammar_s / max(s.wall_s, 1e-9):.1f} % "
              f"of the request)")
    print(f"-- memory: {s.memory_bytes / 2**20:.1f} MiB (weights + KV arena)")
    return 0
