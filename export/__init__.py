"""edgespec export: the workstation side (may use torch). Reads checkpoints, trains drafters, writes bundles."""
