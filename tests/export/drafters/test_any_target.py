"""`edgespec train-drafter KIND --target HF_DIR` serves a user's model: tiny Qwen3 (q/k norms), Qwen2 (biases, tied
head) and Llama targets train every drafter kind for a few steps, from the zoo's domains and from a --data file
the target answers itself, and `edgespec bundle` takes what it wrote for that target (each drafter's greedy
output through a Session equal to plain decoding); a malformed --data line is
refused naming its line and field; the CUDA device is refused where there is none."""
import json
import os

import numpy as np
import pytest

from runtime.cli import main
from tests.support.cli_worker import cli_worker
from tests.support.hf_targets import FAMILIES, save_target

KINDS = ("medusa", "eagle1", "eagle3", "dflash", "dflash2", "mtp")
TINY = ["--steps", "2", "--batch", "2", "--seq-len", "24", "--threads", "1", "--eval-every", "2", "--eval-rows", "2",
        "--cache-rows", "4", "--heads", "2", "--unroll", "2", "--block-sizes", "4", "--anchors", "4",
        "--selector-rank", "8", "--tree-nodes", "4", "--top-k", "16", "--device", "cpu"]
PROMPTS = [{"prompt": "bring me the red cup"},
           {"messages": [{"role": "system", "content": "You plan for a robot."},
                         {"role": "user", "content": "To be, or not to be"},
                         {"role": "assistant", "content": "an answer the target rewrites"}]},
           {"prompt": "pick up the blue box"}]


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("targets"))
    return {f: save_target(root, f) for f in FAMILIES}


def write_jsonl(path, rows):
    with open(path, "w") as f:
        f.write("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return str(path)


@pytest.mark.parametrize("source", ["zoo", "data"])
@pytest.mark.parametrize("family", FAMILIES)
def test_every_drafter_kind_trains_on_the_target_and_the_bundle_takes_it(tmp_path, targets, family, source, capsys):
    target = targets[family]
    data = (["--data", write_jsonl(tmp_path / "d.jsonl", PROMPTS), "--gen-tokens", "10"] if source == "data" else
            ["--zoo-examples", "12", "--zoo-domains", "planner,action"])
    common = ["--target", target, "--cache-dir", str(tmp_path / "cache")] + TINY + data
    for kind in KINDS:
        argv = ["train-drafter", kind, "--out", str(tmp_path / kind), "--work", str(tmp_path / "w" / kind)]
        assert main(argv + common) == 0, capsys.readouterr().err
        with open(tmp_path / "w" / kind / "curve.json") as f:
            curve = json.load(f)
        assert [p["step"] for p in curve["points"]] == [2] and curve["points"][0]["per_depth"]
    out = capsys.readouterr().out
    assert "epoch 1 (2 steps) from the feature cache" in out
    # ids, documents and logits once per cache (training and held-out rows); later kinds only add their taps
    assert out.count("computing doc, final_norm") == 2 and out.count(": computing layer_") >= 2
    bundle = ["bundle", "--target", target, "--out", str(tmp_path / "bundle"), "--medusa", str(tmp_path / "medusa"),
              "--eagle", str(tmp_path / "eagle1"), "--eagle3", str(tmp_path / "eagle3"),
              "--dflash", str(tmp_path / "dflash"), "--dflash", str(tmp_path / "dflash2"), "--mtp", str(tmp_path / "mtp")]
    assert main(bundle) == 0, capsys.readouterr().err
    with open(tmp_path / "bundle" / "bundle.yaml") as f:
        manifest = f.read()
    for name in ("medusa", "eagle", "eagle3", "dflash", "mtp"):
        assert f"kind: {name}" in manifest
    if source == "zoo":  # each trained drafter serves the target exactly: greedy output is plain decoding's
        from runtime.model import bundle as bundle_io
        from runtime.serving.session import GenerationParams, Session

        params = GenerationParams(max_tokens=10)
        want = Session.open(str(tmp_path / "bundle"), drafter="none", backend="numpy_ref").generate(
            "bring me the red cup", params).token_ids
        drafters = sorted(bundle_io.load(str(tmp_path / "bundle")).drafters)
        assert len(want) == 10 and {"medusa", "eagle2", "eagle3", "dflash", "dflash2", "mtp"} <= set(drafters)
        for name in drafters:
            s = Session.open(str(tmp_path / "bundle"), drafter=name, backend="numpy_ref")
            assert s.generate("bring me the red cup", params).token_ids == want, name
            s.close()


BAD_LINES = [
    ('{"prompt": "ok"}\nnot json\n', 'line 2: not valid JSON'),
    ('{"prompt": "ok"}\n\n{"promt": "typo"}\n', 'line 3: expected exactly one of the fields "prompt" and "messages"'),
    ('{"prompt": ""}\n', 'line 1: field "prompt": expected a non-empty string'),
    ('{"messages": [{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}]}\n',
     'line 1: field "messages[1].role": got \'robot\''),
    ('{"messages": [{"role": "user", "content": 3}]}\n', 'line 1: field "messages[0].content": expected a string'),
    ('{"messages": [{"role": "system", "content": "s"}]}\n', 'line 1: field "messages": no user turn to answer'),
    ('[1, 2]\n', 'line 1: expected an object'),
]


@pytest.mark.parametrize("text,message", BAD_LINES)
def test_a_malformed_data_line_is_refused_naming_its_line_and_field(tmp_path, targets, capsys, text, message):
    (tmp_path / "d.jsonl").write_text(text)
    argv = ["train-drafter", "medusa", "--target", targets["qwen3"], "--out", str(tmp_path / "o"),
            "--work", str(tmp_path / "w"), "--cache-dir", str(tmp_path / "c"), "--data", str(tmp_path / "d.jsonl")]
    assert main(argv + TINY) == 2
    err = capsys.readouterr().err
    assert f"--data {tmp_path / 'd.jsonl'} {message}" in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()


def test_cuda_is_refused_in_one_line_where_torch_sees_no_gpu(tmp_path, targets, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: scripts/gpu_check.py runs the CUDA path")
    argv = ["train-drafter", "medusa", "--target", targets["llama"], "--out", str(tmp_path / "o"), "--device", "cuda"]
    assert main(argv) == 2
    assert "--device cuda: torch sees no CUDA GPU" in capsys.readouterr().err


def test_help_says_what_a_real_gpu_run_needs(capsys):
    with pytest.raises(SystemExit):
        main(["train-drafter", "--help"])
    out = capsys.readouterr().out
    assert "GPU-hours" in out and "--data" in out and "torchrun" in out and "NCCL" in out


def test_two_gloo_processes_train_from_the_feature_cache_as_one_does(tmp_path, targets):
    """torchrun-style (gloo on CPU): rank 0 answers the --data prompts and both fill the cache, each its share of
    the shards; the heads trained on half a batch each, gradients averaged, equal the one-process heads."""
    import socket

    import torch.multiprocessing as mp

    from export.drafters.medusa import read_medusa

    data = ["--data", write_jsonl(tmp_path / "d.jsonl", PROMPTS), "--gen-tokens", "10"]
    argv = lambda name: (["train-drafter", "medusa", "--target", targets["qwen2"], "--out", str(tmp_path / name),
                          "--work", str(tmp_path / "w" / name), "--cache-dir", str(tmp_path / f"cache-{name}")]
                         + TINY + data + ["--threads", "2"])
    assert main(argv("one")) == 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(cli_worker, args=(2, port, argv("two")), nprocs=2, join=True, start_method="spawn")
    one, two = read_medusa(str(tmp_path / "one")), read_medusa(str(tmp_path / "two"))
    for k in one.weights:
        np.testing.assert_allclose(two.weights[k], one.weights[k], atol=2e-3, rtol=0)  # fp16 files


def test_until_plateau_without_heldout_rows_is_refused_instead_of_running_forever(tmp_path, targets, capsys):
    argv = ["train-drafter", "medusa", "--target", targets["llama"], "--out", str(tmp_path / "o"), "--work",
            str(tmp_path / "w"), "--cache-dir", str(tmp_path / "c"), "--data", write_jsonl(tmp_path / "d.jsonl",
                                                                                          PROMPTS[:1]),
            "--gen-tokens", "4", "--until-plateau"]
    assert main(argv + TINY) == 2
    assert "--until-plateau: no held-out rows" in capsys.readouterr().err
