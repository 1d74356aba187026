"""torch.ops.fp8attn argument validation beyond the public wrappers."""
import pytest
import torch

import fp8attn  # noqa: F401  (registers torch.ops.fp8attn)


def _inputs():
    bf = torch.bfloat16
    q, k = torch.randn(1, 4, 16, 32, dtype=bf), torch.randn(1, 2, 16, 32, dtype=bf)
    out, lse = torch.ops.fp8attn.fwd(q, k, k, 0.2, True, "fp8", 128)
    return q, k, out, lse


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_bwd_refuses_an_lse_that_is_not_float32(dtype):
    """fwd returns float32 LSE and the CUDA op requires it; the CPU op silently widened a
    rounded LSE (a bf16 one shifts every P = exp(S - LSE) by up to ~2 %)."""
    q, k, out, lse = _inputs()
    with pytest.raises(TypeError, match="'lse'.*float32"):
        torch.ops.fp8attn.bwd(out, q, k, k, out, lse.to(dtype), 0.2, True, "fp8", "delta_matching", 128,
                              "e4m3", False)


def test_bwd_lse_shape_error_says_what_it_got():
    q, k, out, lse = _inputs()
    with pytest.raises(ValueError, match=r"'lse'.*got cpu \[1, 4, 8\]"):
        torch.ops.fp8attn.bwd(out, q, k, k, out, lse[..., :8], 0.2, True, "fp8", "delta_matching", 128,
                              "e4m3", False)


def test_deterministic_on_cpu_and_its_type():
    """attention(deterministic=True) on CPU tensors: the reference is deterministic anyway
    (the raw op's flag is accepted and changes nothing); a non-bool is a TypeError naming it."""
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(1, 2, 70, 32, generator=g, requires_grad=True) for _ in range(3))
    grads = []
    for det in (True, False):
        for t in (q, k, v):
            t.grad = None
        fp8attn.attention(q, k, v, causal=True, deterministic=det).square().sum().backward()
        grads.append([t.grad.clone() for t in (q, k, v)])
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    with pytest.raises(TypeError, match="'deterministic'"):
        fp8attn.attention(q, k, v, deterministic=1)
    qf, kf, vf = (t.detach().transpose(1, 2) for t in (q, k, v))
    assert torch.equal(fp8attn.flash_attn_func(qf, kf, vf, deterministic=True), fp8attn.flash_attn_func(qf, kf, vf))
