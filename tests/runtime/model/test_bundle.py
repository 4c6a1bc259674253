"""Specification of the bundle format (runtime/model/bundle.py) and the HF reader (export/bundle/hf_reader.py).

Every test works on a bundle built by the real export path (the session `tiny_bundle` fixture: HF
save_pretrained -> build_bundle) copied into tmp_path before it is changed, so a test never corrupts the
bundle another test reads."""
from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import yaml

from export.bundle.hf_reader import read_hf_checkpoint, read_weights
from runtime.model import bundle as bundle_io
from runtime.model.bundle import DATA_SUFFIXES, MANIFEST, BundleWriter, sha256_of
from runtime.errors import BundleError
from runtime.model.spec import ModelSpec
from runtime.model.tensors import read_safetensors, write_safetensors

TARGET_FILE = "target/model.safetensors"


# ---------------------------------------------------------------------------------------------- helpers

def copy_bundle(tiny_bundle: str, tmp_path) -> str:
    root = str(tmp_path / "bundle")
    shutil.copytree(tiny_bundle, root)
    return root


def hf_dir(tiny_bundle: str, which: str) -> str:
    """The HF checkpoint the fixture exported from (it sits next to the bundle)."""
    return os.path.join(os.path.dirname(tiny_bundle), which)


def read_manifest(root: str) -> dict:
    with open(os.path.join(root, MANIFEST)) as f:
        return yaml.safe_load(f)


def write_manifest(root: str, manifest) -> None:
    with open(os.path.join(root, MANIFEST), "w") as f:
        yaml.safe_dump(manifest, f, sort_keys=False)


def list_file(root: str, rel: str) -> None:
    """Add `rel` (already on disk) to the manifest's `files` with its true checksum and size."""
    m = read_manifest(root)
    full = os.path.join(root, rel)
    m["files"][rel] = {"sha256": sha256_of(full), "size": os.path.getsize(full)}
    write_manifest(root, m)


def files_on_disk(root: str) -> set:
    out = set()
    for dirpath, _, names in os.walk(root):
        for n in names:
            out.add(os.path.relpath(os.path.join(dirpath, n), root).replace(os.sep, "/"))
    return out - {MANIFEST}


# ---------------------------------------------------------------------------------------------- round trip

def test_round_trip_build_then_load_gives_the_checkpoint_spec_drafters_and_every_file(tiny_bundle):
    b = bundle_io.load(tiny_bundle)

    target_hf = read_hf_checkpoint(hf_dir(tiny_bundle, "target"))
    draft_hf = read_hf_checkpoint(hf_dir(tiny_bundle, "draft"))
    assert b.name == "tiny"
    assert b.target.spec == target_hf.spec
    assert set(b.drafters) == {"ngram", "draft_model"}
    assert b.default_drafter == "draft_model"  # a draft model given -> it is the default
    assert b.drafter("draft_model").spec == draft_hf.spec
    assert b.drafter("draft_model").files == ("draft/model.safetensors",)
    assert b.drafter("ngram").files == () and b.drafter("ngram").kind == "ngram"
    assert b.target_files("numpy_ref").files == (TARGET_FILE,)
    assert os.path.isfile(b.path(b.tokenizer))

    # Every file in the directory is listed with its true sha256 and size, and only data formats are used.
    assert set(b.files) == files_on_disk(tiny_bundle)
    for rel, entry in b.files.items():
        full = b.path(rel)
        assert entry.sha256 == sha256_of(full), rel
        assert entry.size == os.path.getsize(full), rel
        assert rel.endswith(DATA_SUFFIXES), rel

    # The weights on the robot side are the checkpoint's weights (tied head stored once, as the embedding).
    weights = read_safetensors(b.path(TARGET_FILE))
    assert set(weights) == set(target_hf.weights)
    for name, w in target_hf.weights.items():
        np.testing.assert_array_equal(weights[name], w, err_msg=name)


# ---------------------------------------------------------------------------------------------- damaged files

def test_a_flipped_byte_is_refused_naming_the_file_and_what_to_do(tiny_bundle, tmp_path):
    root = copy_bundle(tiny_bundle, tmp_path)
    full = os.path.join(root, TARGET_FILE)
    data = bytearray(open(full, "rb").read())
    data[len(data) // 2] ^= 0x01  # same size: only the checksum can see it
    open(full, "wb").write(bytes(data))

    with pytest.raises(BundleError, match=r"target/model\.safetensors: corrupt \(sha256") as exc:
        bundle_io.load(root)
    assert "copy it again or re-export" in str(exc.value)
    # The fast path (verify_checksums=False) checks sizes only, so it accepts this file: that is its documented trade.
    bundle_io.load(root, verify_checksums=False)


def test_a_truncated_file_is_refused_naming_the_file_and_both_sizes(tiny_bundle, tmp_path):
    root = copy_bundle(tiny_bundle, tmp_path)
    full = os.path.join(root, "draft/model.safetensors")
    size = os.path.getsize(full)
    with open(full, "r+b") as f:
        f.truncate(size - 100)

    for verify in (True, False):  # a size mismatch is caught even without checksums
        with pytest.raises(BundleError, match=r"draft/model\.safetensors: corrupt") as exc:
            bundle_io.load(root, verify_checksums=verify)
        assert f"size {size - 100} bytes" in str(exc.value) and f"manifest says {size}" in str(exc.value)


def test_a_missing_file_is_refused_naming_it(tiny_bundle, tmp_path):
    root = copy_bundle(tiny_bundle, tmp_path)
    os.remove(os.path.join(root, "tokenizer.json"))
    with pytest.raises(BundleError, match=r"tokenizer\.json: missing from the bundle") as exc:
        bundle_io.load(root)
    assert "re-export" in str(exc.value)


def test_a_used_file_without_a_checksum_is_refused(tiny_bundle, tmp_path):
    root = copy_bundle(tiny_bundle, tmp_path)
    m = read_manifest(root)
    del m["files"][TARGET_FILE]
    write_manifest(root, m)
    with pytest.raises(BundleError, match=r"target/model\.safetensors is used but has no checksum"):
        bundle_io.load(root)


def test_a_missing_bundle_directory_or_manifest_says_how_to_build_one(tmp_path):
    with pytest.raises(BundleError, match=r"no such bundle directory; build one with `edgespec bundle --target DIR"):
        bundle_io.load(str(tmp_path / "nowhere"))
    with pytest.raises(BundleError, match=r"bundle\.yaml: missing; this directory is not a bundle"):
        bundle_io.load(str(tmp_path))


# ---------------------------------------------------------------------------------------------- the manifest

@pytest.mark.parametrize("version", [2, 0, "1", None])
def test_an_unsupported_format_version_is_refused_naming_the_version(tiny_bundle, tmp_path, version):
    root = copy_bundle(tiny_bundle, tmp_path)
    m = read_manifest(root)
    m["format_version"] = version
    write_manifest(root, m)
    with pytest.raises(BundleError) as exc:
        bundle_io.load(root)
    msg = str(exc.value)
    assert f"format_version {version!r} is not supported" in msg
    assert f"expected {bundle_io.FORMAT_VERSION}" in msg and "re-export" in msg


def test_a_manifest_that_is_not_yaml_is_refused(tiny_bundle, tmp_path):
    root = copy_bundle(tiny_bundle, tmp_path)
    with open(os.path.join(root, MANIFEST), "w") as f:
        f.write("format_version: 1\ntarget: {spec: [unclosed\n")
    with pytest.raises(BundleError, match=r"bundle\.yaml: not valid YAML"):
        bundle_io.load(root)


@pytest.mark.parametrize("body", ["- format_version\n- 1\n", "just a string\n", ""])
def test_a_manifest_that_is_not_a_mapping_is_refused(tiny_bundle, tmp_path, body):
    root = copy_bundle(tiny_bundle, tmp_path)
    with open(os.path.join(root, MANIFEST), "w") as f:
        f.write(body)
    with pytest.raises(BundleError, match="expected a mapping at the top level"):
        bundle_io.load(root)


@pytest.mark.parametrize("kind", [None, "", 3])
def test_a_drafter_without_a_kind_name_is_refused_naming_it(tiny_bundle, tmp_path, kind):
    # which names are kinds is the drafters' word (tests/runtime/drafters/test_registry.py); a name it must be
    root = copy_bundle(tiny_bundle, tmp_path)
    m = read_manifest(root)
    m["drafters"]["ngram"]["kind"] = kind
    write_manifest(root, m)
    with pytest.raises(BundleError, match=rf"drafters\.ngram\.kind {kind!r}: expected the drafter's kind"):
        bundle_io.load(root)


def _files_as_list(m):
    m["files"] = list(m["files"])


def _drafter_as_string(m):
    m["drafters"]["ngram"] = "ngram"


def _backend_as_list(m):
    m["target"]["backends"]["numpy_ref"] = [TARGET_FILE]


def _spec_with_unknown_key(m):
    m["target"]["spec"]["num_experts"] = 8


def _no_target(m):
    del m["target"]


def _num_layers_as_word(m):
    m["target"]["spec"]["num_layers"] = "eight"


def _unknown_top_level_key(m):
    m["defualt_drafter"] = "ngram"


def _unknown_drafter_key(m):
    m["drafters"]["draft_model"]["taps"] = []


@pytest.mark.parametrize("mutate,where", [
    (_spec_with_unknown_key, "target.spec: num_experts: unknown key"),
    (_no_target, "target: got None, expected a mapping"),
    (_files_as_list, "files: got ["),
    (_drafter_as_string, "drafters.ngram: got 'ngram', expected a mapping"),
    (_backend_as_list, "target.backends.numpy_ref: got ["),
    (_num_layers_as_word, "target.spec: num_layers: got 'eight', expected an integer"),
    (_unknown_top_level_key, "defualt_drafter: unknown key"),
    (_unknown_drafter_key, "drafters.draft_model.taps: unknown key"),
])
def test_a_malformed_manifest_is_a_bundle_error_naming_the_key_and_how_to_rebuild(tiny_bundle, tmp_path, mutate,
                                                                                  where):
    """Never a TypeError deep in a forward pass, never a key ignored silently: the key at fault, by name."""
    root = copy_bundle(tiny_bundle, tmp_path)
    m = read_manifest(root)
    mutate(m)
    write_manifest(root, m)
    with pytest.raises(BundleError) as exc:
        bundle_io.load(root)
    msg = str(exc.value)
    assert f"bundle.yaml: {where}" in msg and "`edgespec bundle --target DIR --out DIR`" in msg, msg


@pytest.mark.parametrize("layers", [9, 7, 0])
def test_a_layer_count_that_does_not_match_the_weights_is_refused_at_load(tiny_bundle, tmp_path, layers):
    root = copy_bundle(tiny_bundle, tmp_path)
    m = read_manifest(root)
    m["target"]["spec"]["num_layers"] = layers
    write_manifest(root, m)
    with pytest.raises(BundleError, match=rf"target\.spec\.num_layers.*{layers}|num_layers: got {layers}"):
        bundle_io.load(root)


def test_a_draft_layer_count_that_does_not_match_its_weights_is_refused(tiny_bundle, tmp_path):
    root = copy_bundle(tiny_bundle, tmp_path)
    m = read_manifest(root)
    m["drafters"]["draft_model"]["spec"]["num_layers"] = 2
    write_manifest(root, m)
    with pytest.raises(BundleError, match=r"drafters\.draft_model\.spec\.num_layers is 2, but "
                                          r"draft/model\.safetensors hold layers 0\.\.0"):
        bundle_io.load(root)


def test_the_manifest_is_replaced_atomically_so_a_hard_linked_copy_keeps_its_own(tiny_bundle, tmp_path):
    """`cp -al` copies of a bundle share inodes: rewriting bundle.yaml in place would change the copy too."""
    root = copy_bundle(tiny_bundle, tmp_path)
    link = str(tmp_path / "linked.yaml")
    os.link(os.path.join(root, MANIFEST), link)
    before = open(link).read()
    w = BundleWriter.extend(root)
    w.set_generation(max_tokens=7)
    w.write()
    assert open(link).read() == before
    assert bundle_io.load(root).generation["max_tokens"] == 7
    assert not [n for n in os.listdir(root) if n.endswith(".tmp")], "no temporary file is left behind"


# ---------------------------------------------------------------------------------------------- no pickles

@pytest.mark.parametrize("suffix", [".bin", ".pt", ".pth", ".pkl"])
def test_a_pickle_file_listed_in_the_manifest_is_refused_without_being_opened(tiny_bundle, tmp_path, suffix):
    root = copy_bundle(tiny_bundle, tmp_path)
    rel = f"target/pytorch_model{suffix}"
    with open(os.path.join(root, rel), "wb") as f:
        f.write(b"\x80\x04this would be unpickled")  # never read: the suffix alone refuses it
    list_file(root, rel)
    m = read_manifest(root)
    m["target"]["backends"]["numpy_ref"]["files"].append(rel)
    write_manifest(root, m)
    with pytest.raises(BundleError, match=rf"pytorch_model\{suffix}: not a data format edgespec loads"):
        bundle_io.load(root)


def test_a_pickle_file_listed_but_used_by_nothing_is_still_refused(tiny_bundle, tmp_path):
    root = copy_bundle(tiny_bundle, tmp_path)
    with open(os.path.join(root, "extra.pt"), "wb") as f:
        f.write(b"\x80\x04")
    list_file(root, "extra.pt")
    with pytest.raises(BundleError, match=r"extra\.pt: not a data format"):
        bundle_io.load(root)


# ---------------------------------------------------------------------------------------------- extend

def test_extend_adds_a_backend_and_load_still_verifies_every_file(tiny_bundle, tmp_path):
    root = copy_bundle(tiny_bundle, tmp_path)
    w = BundleWriter.extend(root)
    with open(w.path("onnx/target.onnx"), "wb") as f:
        f.write(b"not really onnx, but the bundle only checksums it" * 10)
    w.add_target_backend("onnx", ["onnx/target.onnx"], params={"precision": "fp32"})
    w.write()

    b = bundle_io.load(root)
    assert b.target_files("onnx").files == ("onnx/target.onnx",)
    assert b.target_files("onnx").params == {"precision": "fp32"}
    assert b.target_files("numpy_ref").files == (TARGET_FILE,)  # what was there stays
    assert set(b.drafters) == {"ngram", "draft_model"} and b.default_drafter == "draft_model"
    assert b.files["onnx/target.onnx"].sha256 == sha256_of(os.path.join(root, "onnx/target.onnx"))

    with open(os.path.join(root, "onnx/target.onnx"), "r+b") as f:
        f.write(b"N")  # same size, different bytes
    with pytest.raises(BundleError, match=r"onnx/target\.onnx: corrupt \(sha256"):
        bundle_io.load(root)


def test_extend_adds_a_drafter_backend(tiny_bundle, tmp_path):
    root = copy_bundle(tiny_bundle, tmp_path)
    w = BundleWriter.extend(root)
    with open(w.path("onnx/draft.onnx"), "wb") as f:
        f.write(b"graph")
    w.add_drafter_backend("draft_model", "onnx", ["onnx/draft.onnx"])
    w.write()
    b = bundle_io.load(root)
    assert b.drafter("draft_model").backends["onnx"].files == ("onnx/draft.onnx",)


def test_extend_refuses_a_bundle_whose_files_are_already_corrupt(tiny_bundle, tmp_path):
    root = copy_bundle(tiny_bundle, tmp_path)
    full = os.path.join(root, TARGET_FILE)
    data = bytearray(open(full, "rb").read())
    data[-1] ^= 0x01
    open(full, "wb").write(bytes(data))
    with pytest.raises(BundleError, match="corrupt"):
        w = BundleWriter.extend(root)
        w.write()
        bundle_io.load(root)


# ---------------------------------------------------------------------------------------------- lookups

def test_asking_for_a_drafter_the_bundle_lacks_lists_the_ones_it_has(tiny_bundle):
    b = bundle_io.load(tiny_bundle)
    with pytest.raises(BundleError, match=r"no drafter 'nope'") as exc:
        b.drafter("nope")
    assert "['draft_model', 'ngram', 'none']" in str(exc.value)


def test_asking_for_a_backend_the_target_lacks_lists_the_ones_it_has_and_how_to_export(tiny_bundle):
    b = bundle_io.load(tiny_bundle)
    with pytest.raises(BundleError, match=r"no files for backend 'onnx'") as exc:
        b.target_files("onnx")
    assert "['numpy_ref']" in str(exc.value)
    assert f"`edgespec export --to onnx --bundle {tiny_bundle}`" in str(exc.value)


def test_a_backend_without_an_exporter_is_not_pointed_at_a_command_that_does_not_exist(tiny_bundle):
    b = bundle_io.load(tiny_bundle)
    with pytest.raises(BundleError, match=r"no files for backend 'openvino'") as exc:
        b.target_files("openvino")
    assert "cannot export for 'openvino' yet (exporters: onnx, tensorrt, gguf)" in str(exc.value)
    assert "--to openvino" not in str(exc.value)  # `edgespec export` refuses it


# ---------------------------------------------------------------------------------------------- HF reader

def test_a_sharded_checkpoint_reads_the_same_weights_as_the_single_file(tiny_bundle, tmp_path):
    src = hf_dir(tiny_bundle, "target")
    single = read_hf_checkpoint(src)
    weights = read_weights(src)
    names = sorted(weights)
    half = len(names) // 2
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    weight_map = {}
    for shard, keys in shards.items():
        write_safetensors(str(sharded / shard), {k: np.asarray(weights[k]) for k in keys})
        weight_map.update({k: shard for k in keys})
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    for name in ("config.json", "tokenizer.json"):
        shutil.copyfile(os.path.join(src, name), str(sharded / name))

    ck = read_hf_checkpoint(str(sharded))
    assert ck.spec == single.spec
    assert set(ck.weights) == set(single.weights)
    for name, w in single.weights.items():
        np.testing.assert_array_equal(ck.weights[name], w, err_msg=name)


def test_a_shard_named_in_the_index_but_absent_is_refused_naming_it(tmp_path):
    write_safetensors(str(tmp_path / "a.safetensors"), {"x": np.zeros(2, np.float32)})
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"x": "a.safetensors", "y": "b.safetensors"}}))
    with pytest.raises(BundleError, match=r"b\.safetensors: shard named in the index is missing"):
        read_weights(str(tmp_path))


def test_bf16_safetensors_read_back_as_float32_equal_to_torch_widening(tmp_path):
    torch = pytest.importorskip("torch")
    save_file = pytest.importorskip("safetensors.torch").save_file
    g = torch.Generator().manual_seed(0)
    tensors = {
        "w": (torch.randn(7, 5, generator=g) * 3).to(torch.bfloat16),  # (7, 5)
        "extremes": torch.tensor([0.0, -0.0, 1e-40, 3.0e38, -3.0e38, float("inf"), 1 / 3], dtype=torch.bfloat16),
        "scalar": torch.tensor(2.5, dtype=torch.bfloat16),
    }
    save_file(tensors, str(tmp_path / "model.safetensors"))

    got = read_weights(str(tmp_path))
    for name, t in tensors.items():
        want = t.to(torch.float32).numpy()
        assert got[name].dtype == np.float32, name
        assert got[name].shape == want.shape, name
        np.testing.assert_array_equal(got[name], want, err_msg=name)


def test_a_directory_with_only_a_pickle_checkpoint_says_to_convert_to_safetensors(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": 32, "hidden_size": 8, "num_hidden_layers": 1,
        "num_attention_heads": 2, "intermediate_size": 16}))
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04never unpickled")
    with pytest.raises(BundleError, match=r"only pickle checkpoints \(\.bin/\.pt\)") as exc:
        read_hf_checkpoint(str(tmp_path))
    assert "safe_serialization=True" in str(exc.value)


def test_an_unknown_model_type_is_refused_naming_it(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "mamba", "vocab_size": 32, "hidden_size": 8, "num_hidden_layers": 1,
        "num_attention_heads": 2, "intermediate_size": 16}))
    with pytest.raises(BundleError, match=r"model_type 'mamba' is not supported; expected one of"):
        read_hf_checkpoint(str(tmp_path))


def test_spec_survives_the_manifest_round_trip():
    spec = ModelSpec.from_hf_config({
        "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 1024, "num_hidden_layers": 28,
        "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 3072,
        "rope_theta": 1000000.0, "eos_token_id": [151645, 151643], "tie_word_embeddings": True})
    assert ModelSpec.from_dict(yaml.safe_load(yaml.safe_dump(spec.to_dict()))) == spec
