"""varlen_attention with hostile cu_seqlens: every bad one raises naming the argument."""
import pytest
import torch

import fp8attn


def test_meta_cu_seqlens_raise_naming_the_argument():
    q = torch.randn(10, 2, 32, dtype=torch.bfloat16)
    k = torch.randn(10, 1, 32, dtype=torch.bfloat16)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    with pytest.raises(ValueError, match="'cu_seqlens_q'.*meta"):     # was NotImplementedError from tolist()
        fp8attn.varlen_attention(q, k, k, cu.to("meta"), cu)
    with pytest.raises(ValueError, match="'cu_seqlens_k'.*meta"):
        fp8attn.varlen_attention(q, k, k, cu, cu.to("meta"))
