"""export/zoo/model.py: our small Llama must be numerically an HF Llama, and its checkpoint an HF checkpoint."""
from tests.support import REPO_ROOT
import json
import os

import pytest
import torch

from export.zoo.model import LlamaConfig, LlamaLM, hf_state_dict, load_hf, save_hf
from export.zoo.train import packed_inputs

CFG = LlamaConfig(vocab_size=211, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, num_nextn_predict_layers=1)


def _model(seed=0, cfg=CFG):
    torch.manual_seed(seed)
    m = LlamaLM(cfg)
    with torch.no_grad():  # non-trivial norms so a wrong norm placement would show
        for n, p in m.named_parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
    return m.eval()


def test_checkpoint_uses_hf_llama_and_deepseek_mtp_key_names():
    keys = set(hf_state_dict(_model()))
    assert "model.embed_tokens.weight" in keys and "model.norm.weight" in keys and "lm_head.weight" not in keys
    assert "model.layers.2.self_attn.q_proj.weight" in keys and "model.layers.2.mlp.down_proj.weight" in keys
    n = CFG.num_hidden_layers
    for k in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "self_attn.o_proj.weight", "mlp.gate_proj.weight",
              "input_layernorm.weight", "post_attention_layernorm.weight", "shared_head.norm.weight"):
        assert f"model.layers.{n}.{k}" in keys
    assert tuple(hf_state_dict(_model())[f"model.layers.{n}.eh_proj.weight"].shape) == (64, 128)


def test_transformers_llama_loads_the_target_and_gives_the_same_logits(tmp_path):
    transformers = pytest.importorskip("transformers")
    m = _model()
    save_hf(m, str(tmp_path))
    cfg = json.load(open(tmp_path / "config.json"))
    assert cfg["model_type"] == "llama" and cfg["num_nextn_predict_layers"] == 1
    ours = load_hf(str(tmp_path))  # the fp16-rounded weights, in fp32
    hf = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path), torch_dtype=torch.float32).eval()
    ids = torch.randint(0, CFG.vocab_size, (2, 37), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(ids).logits
        got, _ = ours(ids)
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (got - want).abs().max()


def test_load_hf_round_trips_the_mtp_module(tmp_path):
    m = _model()
    save_hf(m, str(tmp_path))
    back = load_hf(str(tmp_path))
    ids = torch.randint(0, CFG.vocab_size, (1, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        l1, h1 = m(ids)
        l2, h2 = back(ids)
        m1 = m.mtp_logits(h1[:, :-1], ids[:, 1:])
        m2 = back.mtp_logits(h2[:, :-1], ids[:, 1:])
    assert torch.allclose(l1, l2, atol=2e-2) and torch.allclose(m1, m2, atol=2e-2)  # fp16 storage


def test_packed_documents_see_only_themselves_and_restart_positions():
    """Two documents packed in one row give the same logits as each run alone (block-diagonal mask)."""
    m = _model()
    a = torch.randint(3, CFG.vocab_size, (9,))
    b = torch.randint(3, CFG.vocab_size, (7,))
    row = torch.cat([a, b, torch.zeros(1, dtype=torch.long)])[None]  # (1, 17): a, b, one pad
    doc = torch.tensor([[0] * 9 + [1] * 7 + [-1]])
    x, pos, mask, labels, mtp_labels = packed_inputs(row, doc)
    with torch.no_grad():
        packed, _ = m(x, pos, mask)
        alone_a, _ = m(a[None])
        alone_b, _ = m(b[None])
    assert torch.allclose(packed[0, :9], alone_a[0], atol=1e-5)
    assert torch.allclose(packed[0, 9:16], alone_b[0], atol=1e-5)
    assert labels[0, 8] == -100 and labels[0, 7] == a[8] and labels[0, 15] == -100
    assert mtp_labels[0, 7] == -100 and mtp_labels[0, 6] == a[8]


SHIPPED = os.path.join(REPO_ROOT, "zoo")


@pytest.mark.skipif(not os.path.exists(os.path.join(SHIPPED, "MANIFEST.yaml")), reason="the zoo is not built")
def test_shipped_zoo_is_small_fp16_and_loads_in_transformers():
    transformers = pytest.importorskip("transformers")
    from safetensors import safe_open

    total = sum(os.path.getsize(os.path.join(d, f)) for sub in ("target", "draft")
                for d, _, fs in os.walk(os.path.join(SHIPPED, sub)) for f in fs)
    assert total <= 25 * 2**20
    for sub in ("target", "draft"):
        with safe_open(os.path.join(SHIPPED, sub, "model.safetensors"), "pt") as f:
            assert all(f.get_tensor(k).dtype == torch.float16 for k in f.keys())
    hf = transformers.LlamaForCausalLM.from_pretrained(os.path.join(SHIPPED, "target"), torch_dtype=torch.float32)
    ours = load_hf(os.path.join(SHIPPED, "target"))
    ids = torch.tensor([[1, 3, 300, 400, 500, 7]])
    with torch.no_grad():
        assert torch.allclose(hf(ids).logits, ours(ids)[0], atol=1e-3)
