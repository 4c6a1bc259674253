"""ROS 2 glue over the edgespec runtime: the lifecycle node, its launcher and a demo client."""
