"""Specification: a bundle the user cannot read is named as unreadable (not "missing")."""
from __future__ import annotations

import os

import pytest

from runtime.errors import BundleError
from runtime.model import bundle as bundle_io


def test_an_unreadable_bundle_directory_is_named_as_such(tiny_bundle, monkeypatch):
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if p == tiny_bundle else real(p, mode))
    with pytest.raises(BundleError, match="cannot read this bundle directory .*permission"):
        bundle_io.load(tiny_bundle)


def test_an_unreadable_data_file_is_named_with_the_reason(tiny_bundle, monkeypatch):
    def denied(path):
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(bundle_io, "sha256_of", denied)
    with pytest.raises(BundleError, match=r"cannot read \(Permission denied\)"):
        bundle_io.load(tiny_bundle)
