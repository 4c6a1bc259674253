"""Helpers of the K-step graph tests (tests/runtime/drafters/test_*_kstep.py)."""
import os

import yaml


def set_kstep(root: str, names, mode: str) -> None:
    """Set params.kstep of the named drafters in the bundle at `root` (bundle.yaml is not a sealed file)."""
    path = os.path.join(root, "bundle.yaml")
    with open(path) as f:
        m = yaml.safe_load(f)
    for name in names:
        m["drafters"][name]["params"] = {**(m["drafters"][name].get("params") or {}), "kstep": mode}
    with open(path, "w") as f:
        yaml.safe_dump(m, f, sort_keys=False)
