"""Standard ROS 2 launch file (robots with a full ROS 2 install: Humble, Jazzy, Kilted).

    ros2 launch edgespec_ros edgespec.launch.py params_file:=/path/to/edgespec.yaml namespace:=/robot1

Starts the edgespec lifecycle node and, unless autostart:=false, drives it to active with the
standard lifecycle events (configure, then activate once configured). The PyPI-wheel machines have
no `launch` package; they use edgespec_ros.launcher with configs/ros/demo_launch.yaml instead.
"""
import lifecycle_msgs.msg
from launch import LaunchDescription
from launch.actions import DeclareLaunchArgument, EmitEvent, RegisterEventHandler
from launch.conditions import IfCondition
from launch.events import matches_action
from launch.substitutions import LaunchConfiguration
from launch_ros.actions import LifecycleNode
from launch_ros.event_handlers import OnStateTransition
from launch_ros.events.lifecycle import ChangeState


def generate_launch_description():
    params_file = LaunchConfiguration("params_file")
    namespace = LaunchConfiguration("namespace")
    autostart = LaunchConfiguration("autostart")

    node = LifecycleNode(
        package="edgespec_ros",
        executable="edgespec_node",
        name="edgespec",
        namespace=namespace,
        parameters=[params_file],
        output="screen",
    )
    configure = EmitEvent(
        event=ChangeState(lifecycle_node_matcher=matches_action(node),
                          transition_id=lifecycle_msgs.msg.Transition.TRANSITION_CONFIGURE),
        condition=IfCondition(autostart),
    )
    activate_when_configured = RegisterEventHandler(
        OnStateTransition(
            target_lifecycle_node=node, start_state="configuring", goal_state="inactive",
            entities=[EmitEvent(event=ChangeState(
                lifecycle_node_matcher=matches_action(node),
                transition_id=lifecycle_msgs.msg.Transition.TRANSITION_ACTIVATE))],
        ),
        condition=IfCondition(autostart),
    )
    return LaunchDescription([
        DeclareLaunchArgument("params_file", description="node parameters (see configs/ros/edgespec.yaml)"),
        DeclareLaunchArgument("namespace", default_value="", description="namespace of the node"),
        DeclareLaunchArgument("autostart", default_value="true", description="configure and activate at start"),
        activate_when_configured,
        node,
        configure,
    ])
