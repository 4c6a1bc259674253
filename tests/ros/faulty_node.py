"""The real edgespec node with one injected fault, for the "backend error mid-generation" test.

A prompt containing FAULT_MARKER arms the target backend to raise BackendError on its 12th forward
(prefill + 11 decode cycles, so tokens were already accepted and streamed): the failure happens inside the
runtime's decode loop, as a backend crash would. Every other request runs untouched."""
import sys

from runtime.errors import BackendError
from runtime.serving.session import Session

FAULT_MARKER = "<<inject backend fault>>"
_open = Session.open.__func__
_generate = Session.generate


def _open_with_fault_hook(cls, *args, **kwargs):
    session = _open(cls, *args, **kwargs)
    target = session.engine.target
    forward = target.forward
    session._fault = {"armed": False, "calls": 0}

    def faulty_forward(*a, **kw):
        state = session._fault
        if state["armed"]:
            state["calls"] += 1
            if state["calls"] >= 12:
                state["armed"] = False
                raise BackendError("injected fault: the target backend failed during a verify forward")
        return forward(*a, **kw)

    target.forward = faulty_forward
    return session


def _generate_arming(self, prompt, *args, **kwargs):
    self._fault.update(armed=FAULT_MARKER in prompt, calls=0)
    return _generate(self, prompt, *args, **kwargs)


def install() -> None:
    """Patch Session in THIS process only: the node script calls it; a test importing FAULT_MARKER must not."""
    Session.open = classmethod(_open_with_fault_hook)
    Session.generate = _generate_arming


if __name__ == "__main__":
    from edgespec_ros.node import main

    install()
    sys.exit(main())
