"""Medusa heads widened for the stand-in (export/zoo/standin.py `widen_medusa`): on the stand-in's hidden [x, 0]
they give exactly the original heads' logits on x (zero padding stays zero through the ResBlocks: SiLU(0) = 0)."""
import numpy as np

from export.zoo.standin import widen_medusa
from runtime.drafters.medusa import MedusaDrafter


def test_widened_heads_predict_what_the_original_heads_predict():
    rng = np.random.default_rng(0)
    H, V, wide = 16, 40, 48
    heads = {}
    for k in range(3):
        for layer in range(2):
            heads[f"{k}.{layer}.linear.weight"] = rng.standard_normal((H, H)).astype(np.float32) * 0.3
            heads[f"{k}.{layer}.linear.bias"] = rng.standard_normal(H).astype(np.float32) * 0.3
        heads[f"{k}.2.weight"] = rng.standard_normal((V, H)).astype(np.float32)
    original, widened = MedusaDrafter(heads), MedusaDrafter(widen_medusa(heads, wide))
    assert widened.out.shape == (3, V, wide)
    x = rng.standard_normal(H).astype(np.float32)
    padded = np.concatenate([x, np.zeros(wide - H, np.float32)])
    np.testing.assert_allclose(widened.head_logits(padded, 3), original.head_logits(x, 3), rtol=1e-5, atol=1e-5)
