"""Helpers shared by the tests: tiny checkpoints and bundles, and where the repository is."""
import os

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
