"""Hugging Face transformers integration (fp8attn.hf): a tiny Llama (GQA, 2 layers)
with attn_implementation="fp8attn" against the same weights on HF's "sdpa".

  * precision "exact": loss, every gradient and the loss after one AdamW step
    match sdpa to float32 rounding; greedy generation (KV cache, one-query decode
    steps) gives the same tokens.
  * precision "fp8": loss within a few percent, gradients correlated; not
    bit-identical to sdpa (the FP8 op really runs).
  * padding masks and attention dropout in training raise NotImplementedError
    (HF would otherwise hand us no mask at all and padding would be ignored).
  * sliding-window layers (Mistral, Qwen2 with use_sliding_window, Gemma 2's local
    layers; HF's `sliding_window` W = fp8attn's window_size (W - 1, 0)): precision
    "exact" matches HF's sdpa (eager for Gemma 2) with the window, training and
    generation, and differs from the same model without the window.
No download: the model is built from a config. Runtime: a few seconds.
"""
from __future__ import annotations

import math

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "AttentionInterface"):
    pytest.skip("transformers has no AttentionInterface", allow_module_level=True)

import fp8attn.hf  # noqa: E402

VOCAB = 128


@pytest.fixture(scope="module", autouse=True)
def _registered():
    fp8attn.hf.register("fp8attn")                                   # precision "fp8"
    fp8attn.hf.register("fp8attn_exact", precision="exact")
    fp8attn.hf.register("fp8attn_b32", precision="fp8", block_size=32, delta_mode="stale")


def build(impl: str, seed: int = 0, **overrides):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      max_position_embeddings=64, attn_implementation=impl, **overrides)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg)


def train_step(model, tokens):
    """One forward + backward + AdamW step; returns (loss, {name: grad}, loss after the step)."""
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    opt.step()
    with torch.no_grad():
        loss_after = float(model(input_ids=tokens, labels=tokens).loss)
    return float(loss.detach()), grads, loss_after


@pytest.fixture(scope="module")
def reference():
    ref = build("sdpa")
    state = {k: v.clone() for k, v in ref.state_dict().items()}
    tokens = torch.randint(0, VOCAB, (2, 48), generator=torch.Generator().manual_seed(5))
    return state, tokens, train_step(ref, tokens)


def rel(a, b):
    return float((a - b).norm() / b.norm())


def test_exact_matches_sdpa(reference):
    state, tokens, (loss_ref, g_ref, after_ref) = reference
    model = build("fp8attn_exact", seed=1)                # different init, then sdpa's weights
    model.load_state_dict(state)
    assert model.config._attn_implementation == "fp8attn_exact"
    loss, grads, after = train_step(model, tokens)
    assert math.isfinite(loss) and abs(loss - loss_ref) <= 1e-4 * abs(loss_ref), (loss, loss_ref)
    assert set(grads) == set(g_ref)
    for n in g_ref:
        assert torch.isfinite(grads[n]).all(), n
        torch.testing.assert_close(grads[n], g_ref[n], rtol=1e-4, atol=1e-6, msg=n)
    # The attention weights do get gradients (the op's backward ran).
    assert all(grads[n].abs().sum() > 0 for n in g_ref if "self_attn" in n)
    # NOTE: weights after AdamW's first step are not compared elementwise: that step is
    # ~lr * sign(g), so float32-rounding-sized gradients (~1e-9) flip freely. The loss is.
    assert after < loss_ref - 0.05 and abs(after - after_ref) <= 1e-3 * after_ref, (after, after_ref)


def test_fp8_close_to_sdpa_but_not_identical(reference):
    state, tokens, (loss_ref, g_ref, _) = reference
    for impl in ("fp8attn", "fp8attn_b32"):
        model = build(impl)
        model.load_state_dict(state)
        loss, grads, _ = train_step(model, tokens)
        assert math.isfinite(loss) and abs(loss - loss_ref) <= 0.03 * loss_ref, (impl, loss, loss_ref)
        q_grad = "model.layers.0.self_attn.q_proj.weight"
        assert torch.isfinite(grads[q_grad]).all()
        assert 0 < rel(grads[q_grad], g_ref[q_grad]) < 0.25, (impl, rel(grads[q_grad], g_ref[q_grad]))
        # Whole-model gradient direction agrees.
        flat = torch.cat([grads[n].flatten() for n in g_ref])
        flat_ref = torch.cat([g_ref[n].flatten() for n in g_ref])
        assert float(torch.nn.functional.cosine_similarity(flat, flat_ref, dim=0)) > 0.99


def _generate_both(state, prompt, **kw):
    """Greedy generate() of the reference weights with SDPA and with fp8attn's exact path."""
    outs = []
    for impl in ("sdpa", "fp8attn_exact"):
        model = build(impl)
        model.load_state_dict(state)
        model.eval()
        with torch.no_grad():
            outs.append(model.generate(prompt, do_sample=False, pad_token_id=0, **kw))
    return outs


def test_exact_generation_matches_sdpa(reference):
    """KV-cache decoding (seqlen_q = 1 against a longer cache) follows HF's semantics."""
    state, tokens, _ = reference
    prompt = tokens[:, :10]
    outs = _generate_both(state, prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6)
    assert outs[0].shape == (2, 16)
    assert torch.equal(outs[0], outs[1])


def test_exact_static_cache_generation_matches_sdpa(reference):
    """generate() with a static KV cache: HF masks the cache's unused slots (prefill and every
    decode step); fp8attn takes that as attention over the filled prefix and generates
    SDPA's tokens (a break test, 2026-12-03: it refused the decode mask as "padding")."""
    state, tokens, _ = reference
    outs = _generate_both(state, tokens[:1, :10], max_new_tokens=5, cache_implementation="static")
    assert outs[0].shape == (1, 15)
    assert torch.equal(outs[0], outs[1])


def test_padding_mask_raises(reference):
    state, tokens, _ = reference
    model = build("fp8attn")
    model.load_state_dict(state)
    mask = torch.ones_like(tokens)
    mask[0, :5] = 0                                       # left padding in one row
    with pytest.raises(NotImplementedError, match="attention_mask"):
        model(input_ids=tokens, attention_mask=mask)
    # An all-ones mask (no real padding) is fine and equals no mask.
    with torch.no_grad():
        a = model(input_ids=tokens, attention_mask=torch.ones_like(tokens)).logits
        b = model(input_ids=tokens).logits
    assert torch.isfinite(a).all() and torch.equal(a, b)


def test_mask_of_other_query_key_dims_is_refused_naming_its_shape():
    """A mask whose last two dims are not (seqlen_q, seqlen_k) cannot be read as a
    pattern over the keys given (HF's decode step of a sliding_window=1 layer passes a
    [1, 1, 1, 1] mask with 6 cached keys): refused naming attention_mask, the dims it
    needs and the shape it got, not as "padding" (the former message; a break test)."""
    import fp8attn.hf
    fwd = fp8attn.hf.make_attention_function()
    q = torch.randn(1, 2, 1, 16)
    k = v = torch.randn(1, 2, 6, 16)
    with pytest.raises(NotImplementedError, match=r"attention_mask.*\(seqlen_q, seqlen_k\) = \(1, 6\).*\[1, 1, 1, 1\]"):
        fwd(None, q, k, v, torch.ones(1, 1, 1, 1, dtype=torch.bool), sliding_window=1)
    # The same keys with a mask of the right dims run (and equal no mask: all keys seen).
    out, _ = fwd(None, q, k, v, torch.ones(1, 1, 1, 6, dtype=torch.bool))
    ref, _ = fwd(None, q, k, v, None, is_causal=False)
    assert torch.equal(out, ref)


def test_dropout_in_training_raises():
    model = build("fp8attn", attention_dropout=0.1)
    tokens = torch.randint(0, VOCAB, (1, 16))
    model.train()
    with pytest.raises(NotImplementedError, match="dropout"):
        model(input_ids=tokens)
    model.eval()                                          # HF passes dropout 0 in eval
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=tokens).logits).all()


def test_mask_classification():
    """Explicit masks: bottom-right causal and all-visible are accepted, padding is not."""
    fn = fp8attn.hf.make_attention_function(precision="exact")
    module = torch.nn.Module()
    module.is_causal = True
    q = torch.randn(1, 4, 6, 8)
    k, v = torch.randn(1, 2, 9, 8), torch.randn(1, 2, 9, 8)
    i, j = torch.arange(6)[:, None], torch.arange(9)[None, :]
    causal = (j <= i + 3)[None, None]
    out, none = fn(module, q, k, v, causal, scaling=0.3)
    assert none is None and out.shape == (1, 6, 4, 8)
    want = fp8attn.attention(q, k, v, causal=True, softmax_scale=0.3, precision="exact").transpose(1, 2)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    additive = torch.zeros(1, 1, 6, 9).masked_fill(~causal, float("-inf"))
    torch.testing.assert_close(fn(module, q, k, v, additive, scaling=0.3)[0], want, rtol=0, atol=0)
    full = fn(module, q, k, v, torch.ones(1, 1, 6, 9, dtype=torch.bool), scaling=0.3)[0]
    torch.testing.assert_close(full, fp8attn.attention(q, k, v, softmax_scale=0.3, precision="exact")
                               .transpose(1, 2), rtol=0, atol=0)
    # Top-left causal over 9 keys never lets a row see keys 6..8: it is causal over the first
    # 6 (a static cache's prefill, its unused slots masked), computed as that.
    tl = fn(module, q, k, v, (j <= i)[None, None], scaling=0.3)[0]
    torch.testing.assert_close(tl, fp8attn.attention(q, k[:, :, :6], v[:, :, :6], causal=True, softmax_scale=0.3,
                                                     precision="exact").transpose(1, 2), rtol=0, atol=0)
    # A static cache's decode step: one query, the filled prefix of 7 of 9 slots visible.
    q1 = q[:, :, :1]
    dec = fn(module, q1, k, v, (j[:, :] < 7)[None, None, :1], scaling=0.3)[0]
    torch.testing.assert_close(dec, fp8attn.attention(q1, k[:, :, :7], v[:, :, :7], softmax_scale=0.3,
                                                      precision="exact").transpose(1, 2), rtol=0, atol=0)
    # Still refused: a per-row pattern that is not causal over a prefix (here: a hole).
    holed = torch.ones(1, 1, 6, 9, dtype=torch.bool)
    holed[..., 3] = False
    with pytest.raises(NotImplementedError, match="attention_mask"):
        fn(module, q, k, v, holed, scaling=0.3)
    # softcap goes to the op (Gemma 2's attn_logit_softcapping; numerics.md section 12)
    capped = fn(module, q, k[:, :, :6], v[:, :, :6], None, scaling=0.3, softcap=2.0)[0]
    torch.testing.assert_close(capped, fp8attn.attention(q, k[:, :, :6], v[:, :, :6], causal=True, softmax_scale=0.3,
                                                         softcap=2.0, precision="exact").transpose(1, 2),
                               rtol=0, atol=0)
    assert not torch.equal(capped, fn(module, q, k[:, :, :6], v[:, :, :6], None, scaling=0.3)[0])
    with pytest.raises(ValueError, match="softcap"):
        fn(module, q, k[:, :, :6], v[:, :, :6], None, softcap=-1.0)
    with pytest.raises(NotImplementedError, match="s_aux"):
        fn(module, q, k[:, :, :6], v[:, :, :6], None, s_aux=torch.zeros(4))


def test_register_rejects_bad_options():
    with pytest.raises(TypeError, match="causal"):
        fp8attn.hf.register("bad", causal=True)
    with pytest.raises(ValueError, match="precision"):
        fp8attn.hf.register("bad", precision="fp4")
    with pytest.raises(TypeError, match="'deterministic'"):
        fp8attn.hf.register("bad", deterministic="yes")
    for name in (3, "", "  ", None):   # were registered as attn_implementation names
        with pytest.raises(TypeError, match="'name'"):
            fp8attn.hf.register(name)


def test_register_deterministic_reaches_the_op(monkeypatch):
    """register(..., deterministic=True) passes the flag to fp8attn.attention on every call
    (CPU: bitwise deterministic anyway; CUDA: the `tile` backward's ordered dQ adds)."""
    seen = []
    real = fp8attn.hf.attention

    def spy(*a, **kw):
        seen.append(kw.get("deterministic"))
        return real(*a, **kw)
    monkeypatch.setattr(fp8attn.hf, "attention", spy)
    module = torch.nn.Module()
    module.is_causal = True
    q, k, v = (torch.randn(1, h, 8, 16) for h in (4, 2, 2))
    for det in (True, False):
        seen.clear()
        fp8attn.hf.make_attention_function(deterministic=det)(module, q, k, v, None, scaling=0.25)
        assert seen == [det]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.bfloat16])
def test_fp8_dtypes_into_the_op(dtype):
    """precision "fp8": float16 goes into the op as it is (run as float32 there), float32
    is cast to bfloat16 (as the trainer does); O comes back in the query's dtype."""
    fn = fp8attn.hf.make_attention_function(precision="fp8")
    module = torch.nn.Module()
    module.is_causal = True
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, h, 12, 16, generator=g).to(dtype) for h in (4, 2, 2))
    out, _ = fn(module, q, k, v, None, scaling=0.25)
    assert out.dtype == dtype and out.shape == (1, 12, 4, 16) and out.is_contiguous()
    work = dtype if dtype == torch.float16 else torch.bfloat16
    want = fp8attn.attention(q.to(work), k.to(work), v.to(work), causal=True, softmax_scale=0.25)
    assert torch.equal(out, want.to(dtype).transpose(1, 2))
    if dtype == torch.float16:  # not the bfloat16 cast of before: FP16's extra mantissa bits reach the op
        via_bf16 = fp8attn.attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), causal=True, softmax_scale=0.25)
        assert not torch.equal(out, via_bf16.half().transpose(1, 2))


# ---- sliding windows ---------------------------------------------------------------


def build_windowed(kind: str, impl: str, seed: int = 0, window=8, softcap=None):
    """A tiny model with sliding-window attention layers (window W = `window` tokens;
    None: the same model without the window)."""
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                  attn_implementation=impl)
    torch.manual_seed(seed)
    if kind == "mistral":   # every layer sliding
        from transformers import MistralConfig, MistralForCausalLM
        return MistralForCausalLM(MistralConfig(sliding_window=window, **common))
    if kind == "qwen2":     # use_sliding_window: every layer from max_window_layers on
        from transformers import Qwen2Config, Qwen2ForCausalLM
        return Qwen2ForCausalLM(Qwen2Config(use_sliding_window=window is not None, sliding_window=window,
                                            max_window_layers=0, **common))
    from transformers import Gemma2Config, Gemma2ForCausalLM   # local / global layers alternate
    return Gemma2ForCausalLM(Gemma2Config(sliding_window=window or 4096, attn_logit_softcapping=softcap,
                                          final_logit_softcapping=None, **common))


def check_against_hf(kind, ref_impl, tokens, feature, without, scale_qk=1.0):
    """fp8attn's exact path (attn_implementation "fp8attn_exact") trains the build_windowed
    model `kind` with `feature` (its keyword arguments) like HF's `ref_impl` attention: the
    loss and every gradient; the feature matters on these inputs (the same weights built
    with `without` instead move the loss); the FP8 path is finite and close, not identical,
    and its gradient points the same way. scale_qk scales the Q / K projections."""
    ref = build_windowed(kind, ref_impl, **feature)
    state = {k: v.clone() * (scale_qk if k.endswith(("q_proj.weight", "k_proj.weight")) else 1.0)
             for k, v in ref.state_dict().items()}
    ref.load_state_dict(state)
    loss_ref, g_ref, _ = train_step(ref, tokens)
    model = build_windowed(kind, "fp8attn_exact", seed=1, **feature)
    model.load_state_dict(state)
    loss, grads, _ = train_step(model, tokens)
    assert math.isfinite(loss) and abs(loss - loss_ref) <= 1e-5 * abs(loss_ref), (loss, loss_ref)
    for n in g_ref:
        assert torch.isfinite(grads[n]).all(), n
        torch.testing.assert_close(grads[n], g_ref[n], rtol=1e-4, atol=1e-6, msg=n)
    plain = build_windowed(kind, ref_impl, **without)
    plain.load_state_dict(state)
    with torch.no_grad():
        loss_plain = float(plain(input_ids=tokens, labels=tokens).loss)
    assert abs(loss_plain - loss_ref) > 100 * abs(loss - loss_ref) + 1e-5, (loss_plain, loss_ref)
    fp8 = build_windowed(kind, "fp8attn", seed=2, **feature)
    fp8.load_state_dict(state)
    loss8, grads8, _ = train_step(fp8, tokens)
    assert math.isfinite(loss8) and 0 < abs(loss8 - loss_ref) <= 0.03 * loss_ref, (loss8, loss_ref)
    flat = torch.cat([grads8[n].flatten() for n in g_ref])
    flat_ref = torch.cat([g_ref[n].flatten() for n in g_ref])
    assert float(torch.nn.functional.cosine_similarity(flat, flat_ref, dim=0)) > 0.99


@pytest.mark.parametrize("kind,ref_impl", [("mistral", "sdpa"), ("qwen2", "sdpa"), ("gemma2", "eager")])
def test_sliding_window_models_match_hf(kind, ref_impl):
    # The window matters on these inputs (40 tokens, W = 8).
    tokens = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(7))
    check_against_hf(kind, ref_impl, tokens, {"window": 8}, {"window": None})


def test_sliding_window_generation_matches_sdpa():
    """Greedy decoding past the window: the decode steps' masks have a left bound."""
    prompt = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(9))
    outs = []
    for impl in ("sdpa", "fp8attn_exact"):
        model = build_windowed("mistral", impl)
        model.eval()
        with torch.no_grad():
            outs.append(model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                       pad_token_id=0, max_new_tokens=10))
    assert outs[0].shape == (2, 22)
    assert torch.equal(outs[0], outs[1])


def test_window_mask_classification():
    """Bottom-right band masks (bool or additive, over all keys or a prefix) are read
    as window_size; the attention function computes them with it; holes still raise."""
    fn = fp8attn.hf.make_attention_function(precision="exact")
    module = torch.nn.Module()
    module.is_causal = True
    g = torch.Generator().manual_seed(4)
    q = torch.randn(1, 4, 6, 8, generator=g)
    k, v = torch.randn(1, 2, 9, 8, generator=g), torch.randn(1, 2, 9, 8, generator=g)
    i, j = torch.arange(6)[:, None], torch.arange(9)[None, :]
    for left, right in ((2, 0), (0, 0), (4, 1), (-1, 2), (3, -1), (1, 30)):
        band = torch.ones(6, 9, dtype=torch.bool)
        if right >= 0:
            band &= j <= i + 3 + right
        if left >= 0:
            band &= j >= i + 3 - left
        kind = fp8attn.hf._classify_mask(band[None, None], 6, 9)
        assert kind is not None, (left, right)
        causal, n, window = kind
        out = fn(module, q, k, v, band[None, None], scaling=0.3)[0]
        want = fp8attn.attention(q, k[:, :, :n], v[:, :, :n], causal=causal, window_size=window, softmax_scale=0.3,
                                 precision="exact").transpose(1, 2)
        torch.testing.assert_close(out, want, rtol=0, atol=0)
        dense = fp8attn.attention(q.double(), k.double(), v.double(), softmax_scale=0.3, precision="exact",
                                  window_size=(left, right)).transpose(1, 2)
        torch.testing.assert_close(out.double(), dense, rtol=1e-6, atol=1e-6)
        additive = torch.zeros(1, 1, 6, 9).masked_fill(~band, float("-inf"))
        torch.testing.assert_close(fn(module, q, k, v, additive, scaling=0.3)[0], out, rtol=0, atol=0)
    assert fp8attn.hf._classify_mask((j <= i + 3)[None, None], 6, 9) == (True, 9, (-1, -1))
    assert fp8attn.hf._classify_mask(((j <= i + 3) & (j >= i + 1))[None, None], 6, 9) == (False, 9, (2, 0))
    # a decode step against a static cache: window over the filled prefix (7 of 9 slots)
    dec = ((j >= 3) & (j < 7))[:, :][None, None, :1]
    assert fp8attn.hf._classify_mask(dec, 1, 9) == (False, 7, (3, -1))
    # not a band: a hole, or a band on the wrong side of the diagonal
    holed = (j <= i + 3).clone()
    holed[:, 1] = False
    shifted = (j <= i + 3) & (j >= i + 3 + 1)
    for bad in (holed, shifted):
        with pytest.raises(NotImplementedError, match="attention_mask"):
            fn(module, q, k, v, bad[None, None], scaling=0.3)


def test_sliding_window_without_a_mask():
    """No mask (HF builds none when the window reaches every key): the window W is
    applied as (W - 1, 0) causal, (W, W) bidirectional; bad values raise naming it."""
    fn = fp8attn.hf.make_attention_function(precision="exact")
    module = torch.nn.Module()
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 20, 8, generator=g) for _ in range(3))
    for causal, window in ((True, (3, 0)), (False, (4, 4))):
        module.is_causal = causal
        out = fn(module, q, k, v, None, scaling=0.3, sliding_window=4)[0]
        want = fp8attn.attention(q, k, v, causal=causal, window_size=window, softmax_scale=0.3, precision="exact")
        torch.testing.assert_close(out, want.transpose(1, 2), rtol=0, atol=0)
    for bad in (0, -3, 2.5, True, "8"):
        with pytest.raises(ValueError, match="sliding_window"):
            fn(module, q, k, v, None, scaling=0.3, sliding_window=bad)


def test_gemma2_attn_logit_softcapping_matches_hf_eager():
    """Gemma 2 with attn_logit_softcapping (HF passes `softcap` to the attention function)
    trains like HF's eager attention. Q / K projections scaled by 10 (logits x100): at init the
    tiny model's logits are so small that a cap of 1.5 changes nothing in FP32 (tanh(x) = x);
    so the cap moves the loss by 7e-3 here, and FP8's gradient keeps a cosine of 0.997 with
    HF's (x40 saturates the cap: FP8's gradient cosine falls to 0.85, on the CPU reference
    too, so not a kernel question)."""
    tokens = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(11))
    check_against_hf("gemma2", "eager", tokens, {"softcap": 1.5}, {}, scale_qk=10.0)
