"""The real edgespec node with two injected configure faults, for the "every configure failure is an ERROR
with its reason" tests (in THIS process only):
  - a bundle path ending in UNREADABLE raises PermissionError while opening, as an unreadable data file would;
  - the ngram drafter's propose raises the ValueError ONNX Runtime gave for an fp16 graph fed float32 (issue
    29), so a session with it opens fine and only a request through the drafter shows it cannot serve."""
import sys

from runtime.drafters.ngram import NgramDrafter
from runtime.serving.session import Session

UNREADABLE = "unreadable-bundle"
TYPE_ERROR = "Unexpected input data type. Actual: (tensor(float16)), expected: (tensor(float))"
_open = Session.open.__func__


def _open_or_deny(cls, bundle_dir, *args, **kwargs):
    if bundle_dir.endswith(UNREADABLE):
        raise PermissionError(13, "Permission denied", f"{bundle_dir}/target.safetensors")
    return _open(cls, bundle_dir, *args, **kwargs)


def _propose(self, ctx):
    raise ValueError(TYPE_ERROR)


if __name__ == "__main__":
    from edgespec_ros.node import main

    Session.open = classmethod(_open_or_deny)
    NgramDrafter.propose = _propose
    sys.exit(main())
