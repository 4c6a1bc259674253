"""What an export leaves behind besides its files: no library chatter on the terminal unless `--verbose` asks
for it (torch.onnx's registry notes, its FutureWarnings / UserWarnings, llama.cpp's loader lines), and files
that all get the mode a normal write gives under the user's umask (onnx's external-data writer and
tempfile.mkstemp make theirs 0o600, which a copy to the robot's user cannot read)."""
import logging
import os
import stat
import warnings

import pytest

from export.library_logs import quiet_library, set_verbose
from export.onnx.graph import export_draft_model_onnx, safetensors_weights
from runtime.model import bundle as bundle_io
from runtime.model.bundle import normal_file_mode, write_atomically
from tests.support import REPO_ROOT


@pytest.fixture
def umask_027():
    old = os.umask(0o027)
    try:
        yield
    finally:
        os.umask(old)


def _mode(path):
    return stat.S_IMODE(os.stat(path).st_mode)


def test_an_onnx_export_is_quiet_and_its_graph_and_data_file_have_the_normal_mode(tiny_bundle, tmp_path, capfd,
                                                                                  umask_027):
    b = bundle_io.load(tiny_bundle)
    d = b.drafters["draft_model"]  # the smallest decoder there: one layer
    out = str(tmp_path / "draft.onnx")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        export_draft_model_onnx(d.spec, safetensors_weights(b, d.files), out)
    err = capfd.readouterr().err
    assert "torchvision" not in err and "Warning" not in err, err
    assert [str(w.message) for w in seen] == []
    assert normal_file_mode() == 0o640
    assert _mode(out) == 0o640 and _mode(out + ".data") == 0o640


def test_a_file_written_atomically_gets_the_umask_mode_not_a_fixed_one(tmp_path, umask_027):
    path = str(tmp_path / "bundle.yaml")
    write_atomically(path, "a: 1\n")
    assert _mode(path) == 0o640


def test_library_warnings_and_logs_are_hidden_around_a_library_call_and_shown_with_verbose(caplog):
    log = logging.getLogger("torch.onnx._internal.exporter._registration")

    def chatter():
        warnings.warn("deprecated internals", FutureWarning)
        log.warning("torchvision is not installed. Skipping torchvision::nms")

    with warnings.catch_warnings(record=True) as seen, caplog.at_level(logging.INFO):
        warnings.simplefilter("always")
        with quiet_library():
            chatter()
        assert seen == [] and caplog.records == []
        chatter()  # outside the library call: a warning still shows
        assert len(seen) == 1 and len(caplog.records) == 1
        set_verbose(True)
        try:
            with quiet_library():
                chatter()
        finally:
            set_verbose(False)
        assert len(seen) == 2 and len(caplog.records) == 2


ZOO = os.path.join(REPO_ROOT, "build", "bundles", "zoo")


@pytest.mark.skipif(not os.path.isfile(os.path.join(ZOO, "bundle.yaml")), reason="the zoo bundle is not built")
def test_a_quantised_gguf_export_keeps_llama_cpps_loader_lines_unless_verbose(tmp_path, capfd, umask_027):
    pytest.importorskip("gguf")
    pytest.importorskip("llama_cpp")
    from export.gguf.writer import write_gguf

    b = bundle_io.load(ZOO, verify_checksums=False)
    weights = safetensors_weights(b, b.target_files("numpy_ref").files)
    out = write_gguf(b.target.spec, weights, b.path(b.tokenizer), str(tmp_path / "t.q8_0.gguf"), "q8_0")
    assert "llama_model_loader" not in capfd.readouterr().err
    assert _mode(out) == 0o640
    set_verbose(True)
    try:
        write_gguf(b.target.spec, weights, b.path(b.tokenizer), str(tmp_path / "v.q8_0.gguf"), "q8_0")
    finally:
        set_verbose(False)
    assert "llama_model_loader" in capfd.readouterr().err
