"""edgespec runtime: what runs on the robot (numpy + the chosen backend; never torch)."""

__version__ = "0.1.0"
