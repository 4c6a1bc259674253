#!/usr/bin/env bash
# The main job on the embedded default: the edgespec ROS 2 node (its own process) serves the zoo bundle; a
# second process sends a planner request and an action-token request and streams a Generate action, printing
# the results and the speculative statistics (tau, speedup vs a plain-decoding node on the same backend).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
if [ ! -f build/bundles/zoo/bundle.yaml ]; then
  echo "demo: build/bundles/zoo is missing; run 'make bundles' (needs zoo/)" >&2
  exit 2
fi
export ROS_DOMAIN_ID=${ROS_DOMAIN_ID:-$(( (RANDOM % 100) + 100 ))}
export ROS_AUTOMATIC_DISCOVERY_RANGE=${ROS_AUTOMATIC_DISCOVERY_RANGE:-LOCALHOST}
export ROS_LOG_DIR=${ROS_LOG_DIR:-$(mktemp -d)}
export EDGESPEC_ROOT=$PWD
echo "demo: ROS_DOMAIN_ID=$ROS_DOMAIN_ID (localhost only), bundle build/bundles/zoo"
exec "$VENV/bin/python" -m edgespec_ros.demo_client --launch configs/ros/demo_launch.yaml "$@"
