"""Specification of where `edgespec bundle` writes (export/bundle/builder.py): nothing it did not write is
ever deleted, an input is never touched, a bundle appears whole or not at all, and a bf16 checkpoint
stays bf16. Every test builds from copies of the tiny fixture's HF checkpoints in tmp_path."""
from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

from export.bundle.builder import build_bundle, dtype_summary
from runtime.model import bundle as bundle_io
from runtime.cli import main
from runtime.errors import BundleError
from runtime.model.tensors import read_safetensors, safetensors_dtypes


@pytest.fixture
def ckpts(tiny_bundle, tmp_path):
    """(target dir, draft dir): copies of the HF checkpoints the tiny bundle was built from."""
    src = os.path.dirname(tiny_bundle)
    for which in ("target", "draft"):
        shutil.copytree(os.path.join(src, which), str(tmp_path / "models" / which))
    return str(tmp_path / "models" / "target"), str(tmp_path / "models" / "draft")


def snapshot(root: str) -> dict:
    """{relative path: bytes} of every file under root."""
    out = {}
    for d, _, names in os.walk(root):
        for n in names:
            full = os.path.join(d, n)
            out[os.path.relpath(full, root)] = open(full, "rb").read()
    return out


def test_bundle_out_refuses_a_non_empty_folder_it_did_not_write(ckpts, tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("the robot's calibration, do not lose")
    for force in (False, True):
        with pytest.raises(BundleError, match="not empty and is not an edgespec bundle.*never deletes"):
            build_bundle(ckpts[0], str(out), force=force)
    assert (out / "notes.txt").read_text() == "the robot's calibration, do not lose"


@pytest.mark.parametrize("where", ["target itself", "parent of the target", "inside the target"])
def test_bundle_out_refuses_to_be_or_hold_or_lie_inside_an_input(ckpts, where):
    target = ckpts[0]
    out = {"target itself": target, "parent of the target": os.path.dirname(target),
           "inside the target": os.path.join(target, "bundle")}[where]
    before = snapshot(os.path.dirname(target))
    with pytest.raises(BundleError, match=r"--out .* the input .*outside every input"):
        build_bundle(target, out, ckpts[1], force=True)
    assert snapshot(os.path.dirname(target)) == before, "the checkpoints are untouched"


def test_bundle_out_refuses_the_draft_checkpoint_too(ckpts):
    with pytest.raises(BundleError, match="the input"):
        build_bundle(ckpts[0], ckpts[1], ckpts[1])


def test_an_existing_bundle_is_replaced_only_with_force(ckpts, tmp_path):
    out = str(tmp_path / "b")
    build_bundle(ckpts[0], out)
    with pytest.raises(BundleError, match="already holds a bundle; pass --force"):
        build_bundle(ckpts[0], out, ckpts[1])
    assert set(bundle_io.load(out).drafters) == {"ngram"}
    build_bundle(ckpts[0], out, ckpts[1], force=True)
    assert set(bundle_io.load(out).drafters) == {"ngram", "draft_model"}
    assert sorted(os.listdir(tmp_path)) == ["b", "models"], "no temporary sibling is left behind"


def test_a_bundle_holding_a_file_its_manifest_does_not_list_is_not_replaced_even_with_force(ckpts, tmp_path):
    out = tmp_path / "b"
    build_bundle(ckpts[0], str(out))
    (out / "target" / "my_notes.md").write_text("mine")
    with pytest.raises(BundleError, match=r"does not list \(\['target/my_notes.md'\]\)"):
        build_bundle(ckpts[0], str(out), force=True)
    assert (out / "target" / "my_notes.md").read_text() == "mine"


def test_an_empty_out_directory_is_used(ckpts, tmp_path):
    out = tmp_path / "empty"
    out.mkdir()
    build_bundle(ckpts[0], str(out))
    assert bundle_io.load(str(out)).name == "empty"


def test_a_failed_build_leaves_the_old_bundle_whole_and_no_partial_one(ckpts, tmp_path):
    """Written into a temporary sibling and renamed: a crash half-way changes nothing at --out."""
    out = str(tmp_path / "b")
    build_bundle(ckpts[0], out)
    before = snapshot(out)

    def crash(staged):
        assert os.path.isfile(os.path.join(staged, "bundle.yaml")) and staged != out
        raise RuntimeError("power cut")

    with pytest.raises(RuntimeError, match="power cut"):
        build_bundle(ckpts[0], out, ckpts[1], force=True, extend=crash)
    assert snapshot(out) == before
    assert sorted(os.listdir(tmp_path)) == ["b", "models"]


def test_the_bundle_cli_refuses_a_folder_it_did_not_write_without_a_traceback(ckpts, tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    assert main(["bundle", "--target", ckpts[0], "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("edgespec bundle: error: --out") and "Traceback" not in err
    assert main(["bundle", "--target", ckpts[0], "--out", str(tmp_path / "b"), "--backends", "tensorrt"]) == 2
    assert "--backends: got 'tensorrt'" in capsys.readouterr().err
    assert not (tmp_path / "b").exists(), "a bad flag is refused before anything is written"


def test_the_bundle_cli_replaces_with_force_and_prints_each_files_dtypes(ckpts, tmp_path, capsys):
    out = str(tmp_path / "b")
    assert main(["bundle", "--target", ckpts[0], "--out", out]) == 0
    assert main(["bundle", "--target", ckpts[0], "--draft", ckpts[1], "--out", out]) == 2
    assert "pass --force" in capsys.readouterr().err
    assert main(["bundle", "--target", ckpts[0], "--draft", ckpts[1], "--out", out, "--force"]) == 0
    printed = capsys.readouterr().out
    assert "target/model.safetensors: fp32 x " in printed and "draft/model.safetensors: fp32 x " in printed


def test_a_bf16_checkpoint_stays_bf16_bit_for_bit_and_the_summary_says_so(tmp_path, tiny_bundle):
    torch = pytest.importorskip("torch")
    import transformers

    from tests.support.tiny_bundle import save_random_llama

    src = str(tmp_path / "bf16")
    save_random_llama(src, 400, 2, 32, 3, os.path.join(os.path.dirname(tiny_bundle), "tokenizer.json"))
    model = transformers.LlamaForCausalLM.from_pretrained(src, torch_dtype=torch.bfloat16)
    model.save_pretrained(src, safe_serialization=True)
    src_file = os.path.join(src, "model.safetensors")
    assert set(safetensors_dtypes(src_file).values()) == {"BF16"}

    out = str(tmp_path / "b")
    build_bundle(src, out)
    stored = os.path.join(out, "target", "model.safetensors")
    assert set(safetensors_dtypes(stored).values()) == {"BF16"}, "not silently widened to fp32"
    want, got = read_safetensors(src_file), read_safetensors(stored)
    for name, arr in got.items():
        np.testing.assert_array_equal(arr, want[name], err_msg=name)
    assert os.path.getsize(stored) < 0.6 * sum(a.size * 4 for a in got.values())  # half the bytes of fp32
    (line,) = dtype_summary(out)
    assert line.startswith("target/model.safetensors: bf16 x ") and "not " not in line


def test_the_dtype_summary_names_tensors_not_in_the_files_main_dtype(tmp_path):
    from runtime.model.tensors import write_safetensors

    os.makedirs(tmp_path / "b" / "target")
    write_safetensors(str(tmp_path / "b" / "target" / "model.safetensors"),
                      {"a": np.zeros(4, np.float16), "b": np.zeros(4, np.float16), "norm": np.zeros(4, np.float32)})
    assert dtype_summary(str(tmp_path / "b")) == ["target/model.safetensors: fp16 x 2, fp32 x 1 (0.0 MiB); "
                                                  "not fp16: norm"]


def test_a_float32_tensor_that_is_not_exact_bf16_is_not_rounded_into_bf16(tmp_path):
    from runtime.model.tensors import write_safetensors

    with pytest.raises(ValueError, match="not exact bf16"):
        write_safetensors(str(tmp_path / "x.safetensors"), {"w": np.array([1 / 3], np.float32)}, bf16=["w"])
