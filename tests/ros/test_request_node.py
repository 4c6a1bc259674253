"""The node's request entities live on hidden helper nodes with few entities (edgespec_ros.request_node says
why: every wake-up of rclpy's executor rebuilds the wait set of everything on the node): ~/plan and
~/action_tokens on one served by a ServiceLoop, ~/generate on another; the names clients use stay the node's."""
from __future__ import annotations

import pytest


@pytest.fixture
def node(ros_env):
    import rclpy

    from edgespec_ros.node import EdgespecNode

    context = rclpy.Context()
    rclpy.init(context=context)
    node = EdgespecNode(namespace="/robot", context=context)
    try:
        yield node
    finally:
        node.service_node.destroy_node()
        node.request_node.destroy_node()
        node.destroy_node()
        rclpy.try_shutdown(context=context)


def test_plan_action_tokens_and_generate_keep_the_nodes_names_on_hidden_helper_nodes(node):
    services, requests = node.service_node, node.request_node
    for helper in (services, requests):
        assert helper.get_name().startswith("_")  # hidden from `ros2 node list`
        assert helper.get_namespace() == "/robot"
    assert sorted(s.srv_name for s in services.services) == ["/robot/edgespec/action_tokens", "/robot/edgespec/plan"]
    assert [w for w in requests.waitables if type(w).__name__ == "ActionServer"]  # ~/generate
    # the ServiceLoop takes action requests first when both wait
    assert [srv.srv_name for srv, _ in node.service_handlers] == ["/robot/edgespec/action_tokens",
                                                                   "/robot/edgespec/plan"]


def test_the_request_wait_sets_hold_no_lifecycle_parameter_or_timer_entities(node):
    for helper in (node.service_node, node.request_node):
        assert not list(helper.timers) and not list(helper.subscriptions)
    assert not any(s.srv_name.startswith("/robot/edgespec/") and s.srv_name.rsplit("/", 1)[1] in
                   ("plan", "action_tokens") for s in node.services)  # the lifecycle node's executor never wakes
    assert len(list(node.service_node.services)) == 2  # no parameter services: they stay on the lifecycle node
    assert not list(node.request_node.services)  # the action's own services live in its ActionServer


def test_the_processs_remappings_still_rename_the_request_services_and_action(ros_env):
    import rclpy
    import rclpy.action

    from edgespec_ros.node import EdgespecNode

    context = rclpy.Context()
    rclpy.init(context=context, args=["--ros-args", "-r", "/remapped/edgespec/plan:=/remapped/planner",
                                      "-r", "/remapped/edgespec/generate:=/remapped/speak"])
    node = EdgespecNode(namespace="/remapped", context=context)
    try:
        names = sorted(s.srv_name for s in node.service_node.services)
        assert names == ["/remapped/edgespec/action_tokens", "/remapped/planner"]
        actions = rclpy.action.get_action_server_names_and_types_by_node(
            node.request_node, node.request_node.get_name(), "/remapped")
        assert [name for name, _ in actions] == ["/remapped/speak"]
    finally:
        node.service_node.destroy_node()
        node.request_node.destroy_node()
        node.destroy_node()
        rclpy.try_shutdown(context=context)
