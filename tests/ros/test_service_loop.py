"""The ServiceLoop (edgespec_ros.service_loop): requests served from one wait set on the thread that took
them, the leadership handed on before serving, so a second request is taken while the first is served;
what a handler leaves for later runs after its answer is sent; stop() ends every thread."""
from __future__ import annotations

import threading
import time

import pytest


@pytest.fixture
def ros(ros_env):
    import rclpy

    context = rclpy.Context()
    rclpy.init(context=context)
    server = rclpy.create_node("loop_server", context=context, start_parameter_services=False)
    client = rclpy.create_node("loop_client", context=context)
    try:
        yield rclpy, context, server, client
    finally:
        client.destroy_node()
        server.destroy_node()
        rclpy.try_shutdown(context=context)


def _call(rclpy, context, client_node, cli, request, timeout_s=20.0):
    from rclpy.executors import SingleThreadedExecutor

    assert cli.wait_for_service(timeout_sec=timeout_s)
    future = cli.call_async(request)
    executor = SingleThreadedExecutor(context=context)
    executor.add_node(client_node)
    try:
        executor.spin_until_future_complete(future, timeout_sec=timeout_s)
    finally:
        executor.remove_node(client_node)
    assert future.done(), "no answer"
    return future.result()


def test_a_second_request_is_taken_and_answered_while_the_first_is_still_being_served(ros):
    from edgespec_interfaces.srv import Plan

    from edgespec_ros.service_loop import ServiceLoop

    rclpy, context, server, client = ros
    second_answered = threading.Event()
    order = []

    def handler(req):
        if req.instruction == "first":  # holds its thread until the second has been answered
            assert second_answered.wait(20.0), "the second request was not served while the first was"
        order.append(req.instruction)
        return Plan.Response(success=True, message=req.instruction), None

    srv = server.create_service(Plan, "/loop/plan", lambda r, s: s)
    loop = ServiceLoop(server, [(srv, handler)], threads=3).start()
    try:
        cli = client.create_client(Plan, "/loop/plan")
        cli2 = client.create_client(Plan, "/loop/plan")
        assert cli.wait_for_service(timeout_sec=20.0)
        first = cli.call_async(Plan.Request(instruction="first"))
        time.sleep(0.2)  # the first is taken and waiting in its handler
        second = _call(rclpy, context, client, cli2, Plan.Request(instruction="second"))
        assert second.message == "second"
        second_answered.set()
        from rclpy.executors import SingleThreadedExecutor

        executor = SingleThreadedExecutor(context=context)
        executor.add_node(client)
        executor.spin_until_future_complete(first, timeout_sec=20.0)
        assert first.result().message == "first"
        assert order == ["second", "first"]
    finally:
        second_answered.set()
        loop.stop()


def test_what_a_handler_leaves_for_later_runs_after_the_answer_is_sent(ros):
    from edgespec_interfaces.srv import Plan

    from edgespec_ros.service_loop import ServiceLoop

    rclpy, context, server, client = ros
    events = []
    srv = server.create_service(Plan, "/loop/later", lambda r, s: s)
    real_send = srv.send_response

    def send(resp, header):
        events.append("sent")
        real_send(resp, header)

    srv.send_response = send

    def handler(req):
        events.append("handled")
        return Plan.Response(success=True), lambda: events.append("later")

    loop = ServiceLoop(server, [(srv, handler)], threads=2).start()
    try:
        cli = client.create_client(Plan, "/loop/later")
        assert _call(rclpy, context, client, cli, Plan.Request(instruction="x")).success
        deadline = time.monotonic() + 10
        while len(events) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert events == ["handled", "sent", "later"]
    finally:
        loop.stop()


def test_a_handler_that_raises_still_answers_and_the_loop_goes_on(ros):
    from edgespec_interfaces.srv import Plan

    from edgespec_ros.service_loop import ServiceLoop

    rclpy, context, server, client = ros
    calls = []

    def handler(req):
        calls.append(req.instruction)
        if req.instruction == "bad":
            raise RuntimeError("a bug")
        return Plan.Response(success=True, message="ok"), None

    srv = server.create_service(Plan, "/loop/raise", lambda r, s: s)
    loop = ServiceLoop(server, [(srv, handler)], threads=1).start()
    try:
        cli = client.create_client(Plan, "/loop/raise")
        assert not _call(rclpy, context, client, cli, Plan.Request(instruction="bad")).success  # the default answer
        assert _call(rclpy, context, client, cli, Plan.Request(instruction="good")).message == "ok"
        assert calls == ["bad", "good"]
    finally:
        loop.stop()


def test_stop_ends_every_thread_even_while_they_wait(ros):
    from edgespec_interfaces.srv import Plan

    from edgespec_ros.service_loop import ServiceLoop

    _, _, server, _ = ros
    srv = server.create_service(Plan, "/loop/stop", lambda r, s: s)
    loop = ServiceLoop(server, [(srv, lambda req: (Plan.Response(), None))], threads=4).start()
    time.sleep(0.1)
    loop.stop(timeout_s=10.0)
    assert not any(t.is_alive() for t in loop._threads)


def test_the_callback_form_runs_what_was_left_for_later_before_returning_the_answer():
    from edgespec_ros.service_loop import as_service_callback

    events = []
    callback = as_service_callback(lambda req: (f"answer to {req}", lambda: events.append("later")))
    assert callback("q", None) == "answer to q" and events == ["later"]
    assert as_service_callback(lambda req: ("a", None))("q", None) == "a"
