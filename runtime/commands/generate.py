"""`edgespec generate`: one request, printed with its speculative statistics."""
from __future__ import annotations

import argparse
import json
import sys

from runtime.commands.common import add_model_args, add_sampling_args, generation_params, runtime_config
from runtime.session import Session

HELP = """Generate text from a bundle and print the speculative-decoding statistics.

examples:
  edgespec generate --prompt "<|bos|><|plan|>bring the red cup to the kitchen<|sep|>"
  edgespec generate --plan "bring the red cup to the kitchen" --drafter ngram
  edgespec generate --prompt "<|bos|><|text|>To be" --temperature 0.8 --seed 3 --json
"""


def register(sub) -> None:
    p = sub.add_parser("generate", help="generate text and print tau, tokens/s and time split",
                       description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="raw prompt text (special tokens such as <|bos|> are recognised)")
    src.add_argument("--plan", metavar="INSTRUCTION", help="a planner instruction (uses the planner prompt template)")
    add_model_args(p)
    add_sampling_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("--stream", action="store_true", help="print text as it is accepted (--prompt and --plan)")
    p.set_defaults(func=run)


def run(args) -> int:
    cfg = runtime_config(args)
    params = generation_params(cfg)
    session = Session(cfg)
    on_delta = (lambda d, n: (sys.stdout.write(d), sys.stdout.flush())) if args.stream and not args.json else None
    if args.plan is not None:
        res = session.plan(args.plan, params=params, on_delta=on_delta)
        record = {"text": res.text, "plan_ok": res.plan_ok, "plan_error": res.plan_error,
                  "finish_reason": res.finish_reason, "stats": res.stats.to_dict()}
    else:
        res = session.generate(args.prompt, params, on_delta=on_delta)
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
    print(f"-- {s.tokens} tokens, finish={res.finish_reason}, drafter={s.drafter}, backend={s.backend}")
    print(f"-- tau={s.tau:.2f} tokens/verify, target forwards={s.target_forwards}, {s.tokens_per_s:.1f} tokens/s, "
          f"ttft={s.ttft_s * 1e3:.1f} ms ({s.prefill_tokens} prompt tokens prefilled, {s.prefix_tokens} kept by the "
          f"prefix cache)")
    print(f"-- time: prefill {s.prefill_s * 1e3:.1f} ms, draft {s.draft_s * 1e3:.1f} ms, verify {s.verify_s * 1e3:.1f} ms, "
          f"other {s.other_s * 1e3:.1f} ms; acceptance by depth {[round(a, 2) for a in s.acceptance_by_depth]}")
    print(f"-- memory: {s.memory_bytes / 2**20:.1f} MiB (weights + KV arena)")
    return 0
