"""The QoS of the node's services and action, shared by the node and its clients.

Requests wait in the middleware until an executor thread takes them, and the node's threads may all be
busy (one per queued request): with the default service QoS (keep last 10), a burst of 64 simultaneous
requests lost 33 unanswered. Keeping all of them lets the node take every request and either queue it
or refuse it with error_field "queue"; its own queue (parameter queue_limit) bounds the work, not the
middleware. A client needs the same on its side: with the default QoS, 7 of 64 clients in a burst
missed their response (a client's response reader also keeps only the last 10)."""
from rclpy.qos import DurabilityPolicy, HistoryPolicy, QoSProfile, ReliabilityPolicy

REQUEST_QOS = QoSProfile(history=HistoryPolicy.KEEP_ALL, reliability=ReliabilityPolicy.RELIABLE,
                         durability=DurabilityPolicy.VOLATILE)


def action_qos_kwargs() -> dict:
    """Keyword arguments for an ActionServer or ActionClient: its three services keep all requests."""
    return dict(goal_service_qos_profile=REQUEST_QOS, result_service_qos_profile=REQUEST_QOS,
                cancel_service_qos_profile=REQUEST_QOS)
