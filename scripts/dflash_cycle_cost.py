"""Cycle-time cost of DFlash vs DFlash-2 drafting beside the zoo target (ONNX backend), block sizes 8 and 16.

The drafters are UNTRAINED (random weights of a real shape: 2 Qwen3-style layers, H 256, FF 768, reading the
target's layer_out.7, which the zoo's ONNX graph exports; DFlash-2: conv_group_size 16, selector rank 64, top-16).
What a drafter costs per cycle does not depend on its training; tau does, and is not measured here. Configurations
are interleaved, 3 rounds x 3 prompts, 48 tokens each, greedy; medians with inter-quartile range.

    PYTHONPATH=$PWD python scripts/dflash_cycle_cost.py [bundle]
"""
import statistics
import sys

import numpy as np

from runtime.backends.factory import load_weights
from runtime.drafters.dflash import DFlashDrafter, DFlashParams, dflash_weight_names, dflash_weight_shapes
from runtime.decode.engine import Engine
from runtime.memory.kv import CacheShape, KVArena
from runtime.model.spec import ModelSpec
from runtime.sampling import SamplingParams
from runtime.serving.session import Session


def untrained_drafter(spec, embed, v2: bool, block: int, layers: int = 2) -> DFlashDrafter:
    cfg = dict(model_type="qwen3", hidden_size=spec.hidden_size, num_hidden_layers=layers, num_attention_heads=8,
               num_key_value_heads=4, head_dim=spec.hidden_size // 8, intermediate_size=3 * spec.hidden_size,
               vocab_size=spec.vocab_size, rms_norm_eps=1e-5, rope_theta=10000.0)
    dspec = ModelSpec.from_hf_config(cfg)
    params = DFlashParams(block, 3, (spec.num_layers - 1,), *((16, 2, 64, 16) if v2 else (0, 0, 0, 0)))
    shapes = dflash_weight_shapes(dspec, params, spec.hidden_size)
    rng = np.random.default_rng(0)
    w = {n: (0.05 * rng.standard_normal(shapes[n])).astype(np.float32) for n in dflash_weight_names(dspec, params)}
    shape = CacheShape(layers, dspec.num_kv_heads, dspec.head_dim)
    cache = KVArena.for_context({"d": shape}, 1100).allocate("d", shape, 1100)
    return DFlashDrafter(dspec, params, w, embed, embed, cache)


def main(bundle: str = "build/bundles/zoo") -> None:
    s = Session.open(bundle, drafter="none", backend="onnx")
    spec = s.target.spec
    tw = load_weights(s.bundle, s.bundle.target_files("numpy_ref").files)
    embed = np.ascontiguousarray(tw["model.embed_tokens.weight"], np.float32)
    prompts = [s.tokenizer.encode(t) for t in ("the robot picks up the red cup and", "navigate to the kitchen then",
                                               "open the drawer and hand")]
    configs = [(v2, b) for b in (8, 16) for v2 in (False, True)]
    res = {c: [] for c in configs}
    for _ in range(3):
        for c in configs:
            engine = Engine(s.target, untrained_drafter(spec, embed, *c), s.engine.eos)
            for prompt in prompts:
                st = engine.generate(prompt, SamplingParams(), 48).stats
                res[c].append((st.draft_s / st.cycles * 1e3, st.verify_s / st.cycles * 1e3, st.draft_s / st.wall_s))
    print("| drafter | block | draft ms/cycle (IQR) | verify ms/cycle | drafter share of wall |")
    print("| --- | --- | --- | --- | --- |")
    for c in configs:
        d, v, share = zip(*res[c])
        print(f"| {'dflash2' if c[0] else 'dflash'} | {c[1]} | {statistics.median(d):.1f} "
              f"({np.percentile(d, 25):.1f}-{np.percentile(d, 75):.1f}) | {statistics.median(v):.1f} | "
              f"{100 * statistics.median(share):.0f}% |")


if __name__ == "__main__":
    main(*sys.argv[1:])
