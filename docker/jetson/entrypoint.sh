#!/usr/bin/env bash
# Entrypoint of the edgespec Jetson image: source ROS 2 and the edgespec workspace, refuse to start the node without
# a mounted bundle (one clear line instead of a traceback), then run the command (by default the lifecycle node with
# configs/ros/edgespec_jetson.yaml).
set -eo pipefail  # not -u: ROS's setup scripts read unset variables
# shellcheck disable=SC1090,SC1091
source "/opt/ros/${ROS_DISTRO}/setup.bash"
# shellcheck disable=SC1091
source /opt/edgespec/ros2_ws/install/setup.bash
bundle="${EDGESPEC_BUNDLE_DIR:-/opt/edgespec/build/bundles/zoo}"
if [ "${1:-}" = "ros2" ] && [ ! -f "$bundle/bundle.yaml" ]; then
  echo "edgespec: no bundle at $bundle (no bundle.yaml): mount one, e.g. EDGESPEC_BUNDLE=/path/on/host" \
       "docker compose -f docker/jetson/docker-compose.yml up" >&2
  exit 2
fi
exec "$@"
