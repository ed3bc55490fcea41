"""Checkpoints, by what reading them needs: `files.py` (names on disk, whole-file checks and pruning: no torch, so
the flow and the launchers use it without loading torch), `ours.py` (our checkpoints' tensors, read and written,
weights only), `foreign.py` (LeanAgent's, ReProver's and DeepSpeed's layouts, read into ours)."""
