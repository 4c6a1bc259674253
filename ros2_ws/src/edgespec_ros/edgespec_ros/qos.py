"""The QoS of the node's services and action, shared by the node and its clients.

Requests wait in the middleware until an executor thread takes them, and the node's threads may all be
busy (one per queued request): with the default service QoS (keep last 10), a burst of 64 simultaneous
requests lost 33 unanswered. A request beyond queue_limit must still reach the node, to be refused with
error_field "queue", so the depth is not tied to queue_limit (which bounds the work): it bounds how many
requests may arrive at one instant, before the node takes them. A client needs the same depth for its
responses: with the default, 7 of 64 clients in a burst missed theirs.

Keep last, not keep all: a reliable keep-all writer waits for every matched reader to acknowledge, so one
stalled client could hold up the responses to all others ("failed to send response (timeout)")."""
from rclpy.qos import DurabilityPolicy, HistoryPolicy, QoSProfile, ReliabilityPolicy

BURST_DEPTH = 1000  # simultaneous requests (or responses) held per service; far beyond a robot's callers

REQUEST_QOS = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=BURST_DEPTH, reliability=ReliabilityPolicy.RELIABLE,
                         durability=DurabilityPolicy.VOLATILE)


def action_qos_kwargs() -> dict:
    """Keyword arguments for an ActionServer or ActionClient: its three services hold a burst too."""
    return dict(goal_service_qos_profile=REQUEST_QOS, result_service_qos_profile=REQUEST_QOS,
                cancel_service_qos_profile=REQUEST_QOS)
