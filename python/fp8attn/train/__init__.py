"""Training harness: real-text data (data), GQA transformer with QK-RMSNorm (model),
trainer with FP8 diagnostics (trainer), attention-mode comparison (compare, report).

Entry point: `python -m fp8attn.train.compare --preset cpu-tiny --out runs/cpu-tiny`.
"""
