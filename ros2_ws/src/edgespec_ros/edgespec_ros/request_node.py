"""The node's request entities on hidden nodes of their own, so a request wakes only a small wait set:
~/plan and ~/action_tokens on one served by a ServiceLoop (edgespec_ros.service_loop: no executor), ~/generate
(the action: goal, cancel and result services, feedback and status topics) on one with an executor.

Why: rclpy's Python executors rebuild the whole wait set on every wake-up, and a service request costs three
(the request, its hand-off to a thread, its end). The lifecycle node also holds 14 services (parameters,
lifecycle, type description) and 7 waitables: 0.38 ms a wake-up on the shared test machine, each holding the
GIL that the request's own thread needs. On their own node the request entities rebuild in a fraction of
that, and lifecycle, parameters and /diagnostics keep their own executor: neither side waits on the other.

The services keep their names (the owner's: /spec/edgespec/plan); the helper node is hidden
(`_edgespec_requests`: a leading underscore) and ignores the process's arguments, which would otherwise
rename it to the owner's name (`__node:=`); the owner resolves the entities' names with its remappings.
"""
from __future__ import annotations

import threading

import rclpy
from rclpy.executors import MultiThreadedExecutor
from rclpy.node import Node
from rclpy.parameter import Parameter


def create_request_node(owner: Node, role: str = "requests") -> Node:
    """A hidden node (`_<owner>_<role>`) in the owner's namespace and context, without parameter or type
    description services (fewer entities: the owner offers both)."""
    return rclpy.create_node(f"_{owner.get_name()}_{role}", namespace=owner.get_namespace(), context=owner.context,
                             use_global_arguments=False, start_parameter_services=False, enable_rosout=False,
                             parameter_overrides=[Parameter("start_type_description_service", value=False)])


def request_name(owner: Node, name: str, service: bool = True) -> str:
    """The absolute name the owner's entity `~/name` resolves to, the owner's remappings applied (e.g.
    /spec/edgespec/plan, or /robot/plan under `--ros-args -r ~/plan:=/robot/plan`): the helper node ignores
    the process's arguments, so the owner resolves its names for it. Actions resolve as topics do in rcl."""
    resolve = owner.resolve_service_name if service else owner.resolve_topic_name
    return resolve(f"~/{name}")


class RequestSpinner:
    """Spins the request node on a MultiThreadedExecutor in a thread of its own: one thread per request
    waiting its turn (the queue's limit) plus a few for refusals."""

    def __init__(self, node: Node, threads: int):
        self.executor = MultiThreadedExecutor(num_threads=threads, context=node.context)
        self.executor.add_node(node)
        self._thread = threading.Thread(target=self._spin, name="edgespec-requests", daemon=True)

    def start(self) -> "RequestSpinner":
        self._thread.start()
        return self

    def _spin(self) -> None:
        try:
            self.executor.spin()  # no timeout: no timer built per wake-up
        except Exception:  # the context shut down under it (the process is exiting)
            pass

    def stop(self) -> None:
        self.executor.shutdown()
        self._thread.join(timeout=5.0)
