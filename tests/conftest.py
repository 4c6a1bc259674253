import pytest

from tests.tiny_bundle import make_tiny_bundle


@pytest.fixture(scope="session")
def tiny_bundle(tmp_path_factory) -> str:
    """Path of a tiny random-weight bundle (target 3 layers, draft 1 layer, real BPE tokenizer)."""
    return make_tiny_bundle(str(tmp_path_factory.mktemp("tiny")))
