"""fp8attn: block-scaled FP8 attention with Delta-Matching backward."""
from . import _lib  # noqa: F401  (registers torch.ops.fp8attn)

__version__ = "0.1.0"
