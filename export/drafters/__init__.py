"""Drafters trained or loaded on the workstation: one shared trainer (`trainer.py`), one module per kind
(`medusa.py`: official head files, training task, bundle entry)."""
