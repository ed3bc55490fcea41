"""A trained model out of leanagent, in another tool's format: `hf.py` (a Hugging Face model folder and card)."""
