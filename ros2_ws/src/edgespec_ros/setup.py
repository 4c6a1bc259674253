"""ament_python layout: `colcon build` on a robot, or `pip install -e` into the PyPI-wheel venv
(scripts/bootstrap_ros.sh). The `runtime` package (edgespec itself) is installed separately."""
from glob import glob

from setuptools import setup

PACKAGE = "edgespec_ros"

setup(
    name=PACKAGE,
    version="0.1.0",
    packages=[PACKAGE],
    data_files=[
        ("share/ament_index/resource_index/packages", [f"resource/{PACKAGE}"]),
        (f"share/{PACKAGE}", ["package.xml"]),
        (f"share/{PACKAGE}/launch", glob("launch/*.launch.py")),
    ],
    install_requires=["setuptools"],
    zip_safe=True,
    description="Lifecycle node serving edgespec speculative decoding over ROS 2.",
    license="Apache-2.0",
    entry_points={
        "console_scripts": [
            "edgespec_node = edgespec_ros.node:main",
            "edgespec_demo_client = edgespec_ros.demo_client:main",
            "edgespec_launch = edgespec_ros.launcher:main",
        ],
    },
)
