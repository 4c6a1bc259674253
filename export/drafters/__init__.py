"""Drafters trained or loaded on the workstation: one shared trainer (`trainer.py`) over the frozen target
(`target.py`, any family the bundle reads), its data (`data.py`: the zoo's domains; `user_data.py`: --data
prompts answered by the target), the feature cache (`features.py`), held-out evaluation (`heldout.py`) and
devices / torchrun (`parallel.py`); per kind, its declaration (`kinds/<name>.py`, found by `registry.py`: its
bundle flags, bundle entry, graphs and trainers) and the code it calls (`medusa.py`: official head files,
training task, bundle entry; `eagle*.py`, `dflash*.py`, `mtp_train.py`, `*_onnx.py`)."""
