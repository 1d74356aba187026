"""Decoder-only GQA transformer with QK-RMSNorm, used to compare attention modes.

Block (pre-norm):  x += Wo . Attn(RoPE(g_q * rms(x Wq)), RoPE(g_k * rms(x Wk)), x Wv)
                   x += W2 (silu(x W1) * (x W3))          (SwiGLU)
with RMSNorm before each sublayer and a final RMSNorm before the (tied) LM head.

QK-RMSNorm gains: one learnable gain per head-dim channel, g_q[c] and g_k[c]
(shape [head_dim]), shared by all heads of the layer - this is the "per head
dim channel" gain of docs/numerics.md section 5, so the gain statistics need
no flattening across heads. `qk_norm=False` removes the norm and the gains.

Attention backends (`attn_mode`), all causal, all fed BF16 Q/K/V:
  "bf16"                torch F.scaled_dot_product_attention on BF16 Q/K/V (the
                        baseline users have);
  "fp8-<delta_mode>"    fp8attn.attention(..., precision="fp8", delta_mode=<delta_mode>)
                        with delta_mode in {stale, matched_do, delta_matching};
  "fp8-cudnn"           cuDNN's FP8 SDPA (per-tensor E4M3, TransformerEngine-style delayed
                        scaling; fp8attn.cudnn_fp8_attention): the FP8 attention a user
                        would pick instead. Each attention core then holds its layer's
                        delayed-scaling state (AttentionCore.cudnn_fp8, buffers
                        amax_history [cudnn_amax_history_len, 10] and scale [10], in the
                        state_dict but not in the weights' fingerprint). Causal rows only
                        (not packed, not context parallel); on CUDA sm_90 at head_dim 128
                        (elsewhere compare skips the mode, naming why).
NOTE: the op contract (numerics.md section 3) has BF16 inputs at the op
boundary (the stale delta uses the BF16 O), so Q/K/V are cast to bfloat16 for
every backend, also on CPU, and O is cast back to the compute dtype.

Mode names of the comparison (parse_mode): an attn_mode above, or a recipe variant
of an fp8attn mode, `<fp8attn mode>[@row|@tile][+hadamard][+smooth_k]` (e.g.
"fp8-delta_matching@tile+hadamard"), whose model runs the base attn_mode with
fp8_scaling / fp8_qk_rotation / fp8_smooth_k set by the suffixes.

Precision scopes (`scope`, fp8 modes only; the "bf16" mode stays BF16 everywhere):
  "attn-core"                  only the attention core is FP8 (the op above);
  "attn-core+projections"      + Wq, Wk, Wv, Wo as fp8attn.linear.FP8Linear (Wq, Wk, Wv
                               applied as one fused FP8 projection: fp8_linear_fused);
  "attn-core+projections+ffn"  + W1, W2, W3 (SwiGLU) as FP8Linear.
FP8Linear shares the nn.Linear parameters, so every scope starts from the same
weights. The embedding / tied LM head and the norms stay in the compute dtype.

Packed documents (`packed=True`): each batch row is a window of the token stream
in which `<|endoftext|>` (id 0) ends a document. Attention is causal within each
document only (cu_seqlens from the separators, `document_segments`), and RoPE
positions restart at 0 in every document, so a packed row computes what the
documents would compute one by one. fp8 modes run fp8attn.varlen_attention; the
bf16 mode runs SDPA with the equivalent block-diagonal causal mask.
"""
from __future__ import annotations

import functools
import math
import re
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

CUDNN_MODE = "fp8-cudnn"   # cuDNN FP8 SDPA with delayed scaling (fp8attn.cudnn_fp8_attention)
FP8ATTN_MODES = ("fp8-stale", "fp8-matched_do", "fp8-delta_matching")   # fp8attn's op, by delta_mode
ATTN_MODES = ("bf16",) + FP8ATTN_MODES + (CUDNN_MODE,)
MODE_GRAMMAR = "<fp8attn mode>[@row|@tile][+hadamard][+smooth_k]"   # recipe variants (parse_mode)
ARCHS = ("gqa", "gdn-hybrid")
FP8_BLOCK_SIZES = (32, 64, 128)   # fp8attn.ops.BLOCK_SIZES
FP8_SCALINGS = ("row", "tile")     # fp8attn.ops.SCALINGS (numerics.md section 9)
FP8_QK_ROTATIONS = ("none", "hadamard")  # fp8attn.ops.QK_ROTATIONS (numerics.md section 10)
FP8_GRAD_FORMATS = ("e4m3", "e5m2")       # fp8attn's grad_format: dO and dS codes (numerics.md sections 2-3)
FP8_MAX_HEAD_DIM = 256            # fp8attn.ops.MAX_HEAD_DIM
SCOPES = ("attn-core", "attn-core+projections", "attn-core+projections+ffn")
EOT_ID = 0   # <|endoftext|> (fp8attn.train.data)


def scope_linear_patterns(scope: str) -> list[str]:
    """Glob patterns (on Transformer.named_modules names) of the nn.Linear layers that
    `scope` runs in FP8: none for "attn-core"; the attention projections Wq, Wk, Wv, Wo
    of the GQA layers for "attn-core+projections"; + the SwiGLU W1, W2, W3 for
    "attn-core+projections+ffn". Never the LM head (nor the embedding, not a linear
    layer), nor the Gated DeltaNet layers' projections. benchmarks/bench_train.py's
    torchao configs convert the same layers as the widest scope."""
    if scope not in SCOPES:
        raise ValueError(f"scope must be one of {SCOPES}, got {scope!r}")
    pats = [] if scope == "attn-core" else ["blocks.*.attn.w[qkvo]"]
    return pats + (["blocks.*.mlp.w[123]"] if scope.endswith("+ffn") else [])


@dataclass(frozen=True)
class ModelConfig:
    """Model shape. n_heads must be a multiple of n_kv_heads (GQA)."""
    vocab_size: int = 4096
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 32
    mlp_hidden: int = 384
    max_seq_len: int = 128
    qk_norm: bool = True
    rope: bool = True            # False = NoPE (no positional encoding; causal mask only)
    rope_base: float = 10000.0
    tie_embeddings: bool = True
    attn_mode: str = "bf16"
    fp8_block_size: int = 128    # fp8attn block size B (numerics.md section 2)
    fp8_scaling: str = "row"     # fp8attn scaling recipe, "row" or "tile" (numerics.md section 9)
    fp8_qk_rotation: str = "none"  # fp8attn qk_rotation, "none" or "hadamard" (numerics.md section 10)
    fp8_smooth_k: bool = False     # fp8attn smooth_k (numerics.md section 10)
    fp8_grad_format: str = "e4m3"  # fp8attn grad_format of the attention backward's dO / dS codes
    init_std: float | None = None  # None = 1/sqrt(d_model)
    scope: str = "attn-core"     # FP8 precision scope of the fp8 modes (SCOPES)
    packed: bool = False         # per-document causal attention from <|endoftext|> separators
    activation_checkpointing: bool = False  # recompute each block in backward (torch.utils.checkpoint)
    arch: str = "gqa"            # "gqa" | "gdn-hybrid" (Gated DeltaNet layers from fla-core between GQA ones)
    gdn_ratio: int = 3           # gdn-hybrid: Gated DeltaNet layers per attention layer (3: GDN, GDN, GDN, attn, ...)
    cudnn_amax_history_len: int = 1024  # fp8-cudnn: amax history length (TE DelayedScaling's default 1024)
    cudnn_margin: int = 0               # fp8-cudnn: scale = fp8_max * 2^-margin / amax (TE's default 0)

    def __post_init__(self):
        from fp8attn.ops import check_bool, fmt_value  # noqa: PLC0415 (lazy, as the other fp8attn imports)
        for name in ("qk_norm", "rope", "tie_embeddings", "fp8_smooth_k", "packed", "activation_checkpointing"):
            # a Python or NumPy bool, stored as a Python bool (to_dict is JSON); an int or str: ValueError
            object.__setattr__(self, name, check_bool(getattr(self, name), name, "train.model.ModelConfig", ValueError))
        if self.attn_mode not in ATTN_MODES:
            raise ValueError(f"attn_mode must be one of {ATTN_MODES}, got {self.attn_mode!r}")
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                     "mlp_hidden", "max_seq_len"):
            val = getattr(self, name)
            if isinstance(val, bool) or not isinstance(val, int) or val < 1:
                raise ValueError(f"{name} must be an int >= 1, got {fmt_value(val)}")
        if not (isinstance(self.rope_base, (int, float)) and math.isfinite(self.rope_base) and self.rope_base > 0):
            raise ValueError(f"rope_base must be finite and > 0, got {self.rope_base!r}")
        if self.init_std is not None and not (isinstance(self.init_std, (int, float))
                                              and math.isfinite(self.init_std) and self.init_std > 0):
            raise ValueError(f"init_std must be None or finite and > 0, got {self.init_std!r}")
        if self.fp8_block_size not in FP8_BLOCK_SIZES:
            raise ValueError(f"fp8_block_size must be one of {FP8_BLOCK_SIZES}, got "
                             f"{fmt_value(self.fp8_block_size)}")
        if self.fp8_scaling not in FP8_SCALINGS:
            raise ValueError(f"fp8_scaling must be one of {FP8_SCALINGS}, got {self.fp8_scaling!r}")
        if self.fp8_qk_rotation not in FP8_QK_ROTATIONS:
            raise ValueError(f"fp8_qk_rotation must be one of {FP8_QK_ROTATIONS}, got {self.fp8_qk_rotation!r}")
        if self.fp8_grad_format not in FP8_GRAD_FORMATS:
            raise ValueError(f"fp8_grad_format must be one of {FP8_GRAD_FORMATS}, got {self.fp8_grad_format!r}")
        if self.arch not in ARCHS:
            raise ValueError(f"arch must be one of {ARCHS}, got {self.arch!r}")
        if isinstance(self.gdn_ratio, bool) or not isinstance(self.gdn_ratio, int) or self.gdn_ratio < 1:
            raise ValueError(f"gdn_ratio must be an int >= 1, got {fmt_value(self.gdn_ratio)}")
        if self.arch == "gdn-hybrid" and self.n_layers < self.gdn_ratio + 1:
            raise ValueError(f"arch gdn-hybrid: gdn_ratio {self.gdn_ratio} needs n_layers >= {self.gdn_ratio + 1} "
                             f"(one attention layer after every {self.gdn_ratio} Gated DeltaNet layers), "
                             f"got {self.n_layers}; a smaller ratio fits: --model gdn_ratio={max(1, self.n_layers - 1)}")
        if self.arch == "gdn-hybrid" and self.packed:
            raise ValueError("arch gdn-hybrid: packed documents are not supported (the Gated DeltaNet state "
                             "would run across document boundaries)")
        from fp8attn.cudnn_fp8_attention import MAX_HISTORY_LEN, MAX_MARGIN  # noqa: PLC0415 (lazy, as its op)
        for name, low, high in (("cudnn_amax_history_len", 1, MAX_HISTORY_LEN), ("cudnn_margin", 0, MAX_MARGIN)):
            val = getattr(self, name)
            if isinstance(val, bool) or not isinstance(val, int) or not low <= val <= high:
                raise ValueError(f"{name} must be an int in [{low}, {high}], got {fmt_value(val)}")
        # NOTE: checked here, not only in the op, so that a comparison fails before it
        # trains its bf16 mode rather than after.
        if self.attn_mode.startswith("fp8-") and self.head_dim > FP8_MAX_HEAD_DIM:
            raise ValueError(f"head_dim must be <= {FP8_MAX_HEAD_DIM} for the fp8 attention modes, "
                             f"got {fmt_value(self.head_dim)}")
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        if self.rope and self.head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim, got {fmt_value(self.head_dim)}")
        if self.scope not in SCOPES:
            raise ValueError(f"scope must be one of {SCOPES}, got {self.scope!r}")

    def to_dict(self) -> dict:
        return asdict(self)


# ----------------------------------------------------------------------------
# Mode names of the comparison: an attention mode, or an fp8attn mode's recipe variant
# ----------------------------------------------------------------------------

_SCALING_ORDER = (None,) + FP8_SCALINGS


@dataclass(frozen=True)
class ModeSpec:
    """A mode name of the comparison (compare --modes; log, checkpoint and report name):
    an attention mode of ATTN_MODES, or a recipe variant of an fp8attn mode,
        <fp8attn mode>[@row|@tile][+hadamard][+smooth_k]    (MODE_GRAMMAR)
    whose suffixes override the run's fp8_scaling / fp8_qk_rotation / fp8_smooth_k for
    that mode only (None: the run's setting). `name` is the canonical spelling (suffixes
    in the order @scaling, +hadamard, +smooth_k); the model's attn_mode is `base`."""
    base: str
    scaling: str | None = None       # "row" | "tile" | None
    qk_rotation: str | None = None   # "hadamard" | None
    smooth_k: bool | None = None     # True | None

    @property
    def name(self) -> str:
        return (self.base + (f"@{self.scaling}" if self.scaling else "")
                + ("+hadamard" if self.qk_rotation else "") + ("+smooth_k" if self.smooth_k else ""))

    @property
    def is_variant(self) -> bool:
        return (self.scaling, self.qk_rotation, self.smooth_k) != (None, None, None)

    @property
    def delta_mode(self) -> str | None:
        """fp8attn's delta_mode of the base mode (None for bf16 and fp8-cudnn)."""
        return self.base[len("fp8-"):] if self.base in FP8ATTN_MODES else None

    def overrides(self) -> dict:
        """The ModelConfig fields this name sets ({} for a plain mode)."""
        out = {}
        if self.scaling is not None:
            out["fp8_scaling"] = self.scaling
        if self.qk_rotation is not None:
            out["fp8_qk_rotation"] = self.qk_rotation
        if self.smooth_k is not None:
            out["fp8_smooth_k"] = self.smooth_k
        return out

    def apply(self, cfg: "ModelConfig") -> "ModelConfig":
        """cfg (the run's model config) for this mode: attn_mode = base, the overrides set."""
        return replace(cfg, attn_mode=self.base, **self.overrides())


_SUFFIXES = {"@row": ("scaling", "row"), "@tile": ("scaling", "tile"),
             "+hadamard": ("qk_rotation", "hadamard"), "+smooth_k": ("smooth_k", True)}


def parse_mode(name: str) -> ModeSpec:
    """The ModeSpec of a mode name (see ModeSpec). ValueError naming the name and what is
    allowed for: an unknown mode, suffixes on bf16 / fp8-cudnn, an unknown or repeated
    suffix, suffixes out of the canonical order (the message gives the canonical name)."""
    cut = min((i for i in (name.find("@"), name.find("+")) if i >= 0), default=len(name))
    base, rest = name[:cut], name[cut:]
    if base not in ATTN_MODES:
        raise ValueError(f"unknown mode {name!r}; choose from {','.join(ATTN_MODES)} (an fp8attn mode may "
                         f"take recipe suffixes: {MODE_GRAMMAR})")
    if not rest:
        return ModeSpec(base)
    if base not in FP8ATTN_MODES:
        raise ValueError(f"{name!r}: {base} takes no recipe suffixes; they apply to the fp8attn modes "
                         f"{', '.join(FP8ATTN_MODES)} only: {MODE_GRAMMAR}")
    fields = {}
    for tok in re.findall(r"[@+][^@+]*", rest):
        if tok not in _SUFFIXES:
            raise ValueError(f"{name!r}: unknown suffix {tok!r}; allowed: @row or @tile, +hadamard, +smooth_k "
                             f"({MODE_GRAMMAR})")
        field, val = _SUFFIXES[tok]
        if field in fields:
            what = "a scaling suffix (@row or @tile)" if field == "scaling" else tok
            raise ValueError(f"{name!r}: {what} given twice; each suffix at most once ({MODE_GRAMMAR})")
        fields[field] = val
    spec = ModeSpec(base, **fields)
    if spec.name != name:
        raise ValueError(f"{name!r}: suffixes out of order; write {spec.name!r} (the order is @row|@tile, "
                         f"+hadamard, +smooth_k: {MODE_GRAMMAR})")
    return spec


def is_mode_name(name: str) -> bool:
    """True for a canonical mode name (an attention mode or a recipe variant)."""
    try:
        parse_mode(name)
    except ValueError:
        return False
    return True


def mode_model_config(cfg: "ModelConfig", mode: str) -> "ModelConfig":
    """The run's model config `cfg` for mode name `mode` (attn_mode and recipe overrides)."""
    return parse_mode(mode).apply(cfg)


def mode_sort_key(name: str) -> tuple:
    """Order of mode names: ATTN_MODES' order, each base mode before its variants
    (@row, @tile; +hadamard, +smooth_k); names that do not parse go last, by name."""
    try:
        s = parse_mode(name)
    except ValueError:
        return (len(ATTN_MODES), 0, 0, 0, name)
    return (ATTN_MODES.index(s.base), _SCALING_ORDER.index(s.scaling), s.qk_rotation is not None,
            s.smooth_k is not None, name)


# ----------------------------------------------------------------------------
# Attention backend: the one switch between the BF16 baseline and fp8attn
# ----------------------------------------------------------------------------

def attention_backend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mode: str,
                      layer_name: str, block_size: int = 128, scaling: str = "row", qk_rotation: str = "none",
                      smooth_k: bool = False, grad_format: str = "e4m3") -> torch.Tensor:
    """Causal attention. q [B, Hq, S, D], k/v [B, Hkv, S, D] (GQA by head count).

    Returns O [B, Hq, S, D] in q's dtype. Q/K/V are cast to BF16 first (op contract).
    layer_name labels this call in fp8attn.diagnostics.record() records (fp8 modes).
    """
    if mode == CUDNN_MODE:
        raise ValueError(f"attention mode {CUDNN_MODE!r} keeps per-layer delayed-scaling state: call it through "
                         "AttentionCore (a Transformer built with that attn_mode) or "
                         "fp8attn.cudnn_fp8_attention.cudnn_fp8_attention")
    dtype = q.dtype
    qb, kb, vb = q.to(torch.bfloat16), k.to(torch.bfloat16), v.to(torch.bfloat16)
    if mode == "bf16":
        o = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True,
                                           enable_gqa=q.shape[1] != k.shape[1])
    elif mode.startswith("fp8-"):
        import fp8attn
        o = fp8attn.attention(qb, kb, vb, causal=True, precision="fp8", delta_mode=mode[len("fp8-"):],
                              block_size=block_size, layer_name=layer_name, scaling=scaling,
                              qk_rotation=qk_rotation, smooth_k=smooth_k, grad_format=grad_format)
    else:
        raise ValueError(f"unknown attention mode {mode!r}; expected one of {ATTN_MODES}")
    return o.to(dtype)


def document_segments(tokens: torch.Tensor, eot_id: int = EOT_ID):
    """Documents of packed rows: (cu_seqlens, positions).

    tokens: int [B, S]. A document ends at an `eot_id` token (inclusive) or at the
    end of its row; a row never continues into the next one.
    Returns cu_seqlens int64 [num_docs + 1] over the B*S flattened tokens (row
    major, starting at 0, ending at B*S) and positions int64 [B, S]: each token's
    index inside its document.
    """
    b, s = tokens.shape
    idx = torch.arange(s, device=tokens.device).expand(b, s)
    start = torch.zeros(b, s, dtype=torch.bool, device=tokens.device)
    start[:, 0] = True
    start[:, 1:] = tokens[:, :-1] == eot_id
    first = torch.where(start, idx, torch.zeros_like(idx)).cummax(dim=1).values
    flat = (start.flatten().nonzero().flatten())
    cu = torch.cat([flat, torch.tensor([b * s], device=tokens.device)]).to(torch.int64)
    return cu, idx - first


def packed_attention_backend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, *,
                             mode: str, layer_name: str, block_size: int = 128,
                             scaling: str = "row", qk_rotation: str = "none",
                             smooth_k: bool = False, grad_format: str = "e4m3") -> torch.Tensor:
    """Per-document causal attention on packed rows: q [B, Hq, S, D], k/v [B, Hkv, S, D],
    cu_seqlens from `document_segments` (over the B*S flattened tokens).
    Returns O [B, Hq, S, D] in q's dtype; Q/K/V cast to BF16 as in attention_backend."""
    if mode == CUDNN_MODE:
        raise ValueError(f"attention mode {CUDNN_MODE!r}: packed documents are not supported "
                         "(per-document masks are not implemented for cuDNN's FP8 SDPA here)")
    dtype = q.dtype
    b, hq, s, d = q.shape
    hkv = k.shape[1]
    qb, kb, vb = q.to(torch.bfloat16), k.to(torch.bfloat16), v.to(torch.bfloat16)
    if mode == "bf16":
        doc = torch.zeros(b * s, dtype=torch.int64, device=q.device)
        doc[cu_seqlens[1:-1]] = 1
        doc = doc.cumsum(0).view(b, s)
        causal = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
        mask = (doc[:, :, None] == doc[:, None, :]) & causal           # [B, S, S] block-diagonal causal
        # NOTE: K/V repeated for GQA (SDPA's enable_gqa with an explicit mask is not
        # available on every backend).
        rep = hq // hkv
        o = F.scaled_dot_product_attention(qb, kb.repeat_interleave(rep, 1), vb.repeat_interleave(rep, 1),
                                           attn_mask=mask[:, None])
    elif mode.startswith("fp8-"):
        import fp8attn
        flat = lambda t: t.transpose(1, 2).reshape(b * s, t.shape[1], t.shape[3])
        o = fp8attn.varlen_attention(flat(qb), flat(kb), flat(vb), cu_seqlens, cu_seqlens, causal=True,
                                     precision="fp8", delta_mode=mode[len("fp8-"):], block_size=block_size,
                                     layer_name=layer_name, scaling=scaling, qk_rotation=qk_rotation,
                                     smooth_k=smooth_k, grad_format=grad_format)
        o = o.view(b, s, hq, -1).transpose(1, 2)
    else:
        raise ValueError(f"unknown attention mode {mode!r}; expected one of {ATTN_MODES}")
    return o.to(dtype)


@dataclass(frozen=True)
class ContextParallel:
    """The sequence split of a context-parallel run (fp8attn.context_parallel):
    this rank's place in its context-parallel group; tokens cut into equal zigzag
    chunks (chunk_align 1, so seq_len must be a multiple of 2 * world_size)."""
    group: object
    rank: int
    world_size: int
    layout: str = "zigzag"

    def positions(self, seqlen: int, device) -> torch.Tensor:
        from fp8attn import context_parallel as cp
        return cp.positions(seqlen, self.rank, self.world_size, layout=self.layout, block_size=1, device=device)

    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        from fp8attn import context_parallel as cp
        return cp.shard(x, layout=self.layout, dim=dim, block_size=1, rank=self.rank, world_size=self.world_size)


class _GatherSeq(torch.autograd.Function):
    """Every rank's [B, H, S_local, D] concatenated along the sequence (rank order);
    backward: the gradients summed over the group (all-reduce), this rank's slice.
    NOTE: not torch.distributed.nn.functional.all_gather: its gloo backward scatters
    with group ranks as global ranks (fails on subgroups, torch 2.11)."""

    @staticmethod
    def forward(ctx, x, group, rank, world):
        import torch.distributed as dist
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous(), group=group)
        ctx.group, ctx.rank, ctx.n = group, rank, x.shape[2]
        return torch.cat(parts, 2)

    @staticmethod
    def backward(ctx, g):
        import torch.distributed as dist
        g = g.contiguous().clone()
        dist.all_reduce(g, group=ctx.group)
        return g.narrow(2, ctx.rank * ctx.n, ctx.n), None, None, None


def context_parallel_backend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp_ctx: ContextParallel,
                             positions: torch.Tensor, *, mode: str, layer_name: str, block_size: int = 128,
                             scaling: str = "row", qk_rotation: str = "none", smooth_k: bool = False,
                             grad_format: str = "e4m3") -> torch.Tensor:
    """Causal attention over a sequence sharded across cp_ctx.group: q [B, Hq, S_local, D],
    k/v [B, Hkv, S_local, D] (this rank's zigzag chunks), positions int64 [S_local] (global).
    fp8 modes: fp8attn.context_parallel.ring_attention (ring, global Delta-Matching delta).
    bf16: SDPA of the local queries against every rank's K/V (a differentiable all-gather,
    O(S) K/V memory per rank; a baseline, not a ring). layer_name is unused (the ring has no
    per-call diagnostics). Returns O [B, Hq, S_local, D] in q's dtype."""
    if mode == CUDNN_MODE:
        raise ValueError(f"attention mode {CUDNN_MODE!r}: context parallelism is not supported")
    dtype = q.dtype
    qb, kb, vb = q.to(torch.bfloat16), k.to(torch.bfloat16), v.to(torch.bfloat16)
    if mode == "bf16":
        pos_all = [ContextParallel(cp_ctx.group, r, cp_ctx.world_size, cp_ctx.layout).positions(
            positions.numel() * cp_ctx.world_size, q.device) for r in range(cp_ctx.world_size)]
        k_all = _GatherSeq.apply(kb, cp_ctx.group, cp_ctx.rank, cp_ctx.world_size)
        v_all = _GatherSeq.apply(vb, cp_ctx.group, cp_ctx.rank, cp_ctx.world_size)
        kpos = torch.cat(pos_all)
        mask = kpos[None, :] <= positions[:, None]                 # [S_local, S] global causal
        rep = q.shape[1] // k.shape[1]
        o = F.scaled_dot_product_attention(qb, k_all.repeat_interleave(rep, 1), v_all.repeat_interleave(rep, 1),
                                           attn_mask=mask)
    elif mode.startswith("fp8-"):
        from fp8attn import context_parallel as cp
        o = cp.ring_attention(qb, kb, vb, cp_ctx.group, causal=True, delta_mode=mode[len("fp8-"):],
                              block_size=block_size, scaling=scaling, layout=cp_ctx.layout,
                              qk_rotation=qk_rotation, smooth_k=smooth_k, chunk_align=1, grad_format=grad_format)
    else:
        raise ValueError(f"unknown attention mode {mode!r}; expected one of {ATTN_MODES}")
    return o.to(dtype)


# ----------------------------------------------------------------------------
# Layers
# ----------------------------------------------------------------------------

class RMSNorm(nn.Module):
    """y = x / rms(x) * weight over the last dim (eps 1e-6); weight init 1."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).to(x.dtype)


def rope_tables(seq_len: int, head_dim: int, base: float):
    """cos/sin tables [seq_len, head_dim/2] (fp32) for rotary embeddings on channel pairs (c, c+D/2)."""
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    ang = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv)
    return ang.cos(), ang.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               positions: torch.Tensor | None = None) -> torch.Tensor:
    """Rotates x [B, H, S, D] by position (half-split channel pairing); positions
    int [B, S] (packed documents) or None (0..S-1)."""
    s = x.shape[-2]
    if positions is None:
        cos, sin = cos[:s].to(x.dtype), sin[:s].to(x.dtype)
    else:
        cos, sin = cos[positions].to(x.dtype)[:, None], sin[positions].to(x.dtype)[:, None]
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class AttentionCore(nn.Module):
    """Parameter-free module around the attention backends: O = core(Q, K, V), with
    cu_seqlens (packed documents) `packed_attention_backend`, else `attention_backend`.

    It exists so that forward hooks can see the attention core's inputs (Q, K, V
    after QK-norm and RoPE, [B, H, S, D]) and its output O, and tensor hooks on O
    its upstream gradient dO (fp8attn.train.probe). No parameters; in mode
    fp8-cudnn it holds the layer's delayed-scaling state `cudnn_fp8`
    (fp8attn.cudnn_fp8_attention.DelayedScalingState: buffers, in the state_dict),
    else no state_dict entries. A state_dict with a `cudnn_fp8` state loads into a
    core without one (the state is dropped), and one without into a core with one
    (a fresh state), so checkpoints move between modes.
    """

    cp: ContextParallel | None = None   # set by Transformer.set_context_parallel

    def __init__(self, cudnn_state: nn.Module | None = None):
        super().__init__()
        self.cudnn_fp8 = cudnn_state

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        if self.cudnn_fp8 is None:
            # NOTE: a checkpoint of the fp8-cudnn mode loaded into another mode: its scaling state is not weights
            for key in [k for k in state_dict if k.startswith(prefix + "cudnn_fp8.")]:
                del state_dict[key]
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)

    def forward(self, q, k, v, *, mode: str, layer_name: str, block_size: int = 128,
                cu_seqlens: torch.Tensor | None = None, scaling: str = "row", qk_rotation: str = "none",
                smooth_k: bool = False, positions: torch.Tensor | None = None, grad_format: str = "e4m3"):
        opts = dict(mode=mode, layer_name=layer_name, block_size=block_size, scaling=scaling,
                    qk_rotation=qk_rotation, smooth_k=smooth_k, grad_format=grad_format)
        if mode == CUDNN_MODE and self.cp is None and cu_seqlens is None:
            if self.cudnn_fp8 is None:
                raise ValueError(f"attention mode {CUDNN_MODE!r}: this core has no delayed-scaling state "
                                 "(build the model with that attn_mode, or switch with Transformer.with_attn_mode)")
            from fp8attn.cudnn_fp8_attention import cudnn_fp8_attention
            return cudnn_fp8_attention(q, k, v, self.cudnn_fp8, causal=True).to(q.dtype)
        if self.cp is not None:
            return context_parallel_backend(q, k, v, self.cp, positions, **opts)
        if cu_seqlens is None:
            return attention_backend(q, k, v, **opts)
        return packed_attention_backend(q, k, v, cu_seqlens, **opts)


def cudnn_scaling_state(cfg: ModelConfig) -> nn.Module | None:
    """A fresh delayed-scaling state for an attention layer of mode fp8-cudnn (None for other modes)."""
    if cfg.attn_mode != CUDNN_MODE:
        return None
    from fp8attn.cudnn_fp8_attention import DelayedScalingState
    return DelayedScalingState(history_len=cfg.cudnn_amax_history_len, margin=cfg.cudnn_margin)


def is_scaling_state_key(name: str) -> bool:
    """True for the state_dict entries of fp8-cudnn's delayed-scaling state (not weights)."""
    return ".core.cudnn_fp8." in name or name.startswith("core.cudnn_fp8.")


class Attention(nn.Module):
    """GQA self-attention with optional QK-RMSNorm (gains q_norm.weight = g_q, k_norm.weight = g_k).

    In the FP8 "projections" scopes, with `fuse_fp8_qkv = True` (class or instance; the
    default), Wq, Wk, Wv run as one fused FP8 projection (`qkv`; numerics.md section 8);
    False runs the three FP8Linear layers separately (same parameters either way).

    NOTE: on by default since the H100 measurement of 2026-12-07 (docs/benchmarks.md):
    gpu-1b's linear layers per step 301.9 ms fused against 332.2 ms separate (BF16: 302.6 ms);
    its CUDA tests (tests/python/test_linear_fused.py) passed on the same GPU."""

    fuse_fp8_qkv = True

    def __init__(self, cfg: ModelConfig, layer_name: str):
        super().__init__()
        self.cfg = cfg
        self.layer_name = layer_name
        self.wq = nn.Linear(cfg.d_model, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim) if cfg.qk_norm else None
        self.core = AttentionCore(cudnn_scaling_state(cfg))

    def fused_fp8_qkv(self) -> bool:
        """True when Wq, Wk, Wv run as one fused FP8 projection (`qkv`): all three are
        FP8Linear (the "projections" scopes) with the same grad_format and backend, and
        `fuse_fp8_qkv` is on."""
        if not self.fuse_fp8_qkv:
            return False
        from fp8attn.linear import FP8Linear   # noqa: PLC0415 (lazy, as _apply_scope)
        lins = (self.wq, self.wk, self.wv)
        return (all(type(m) is FP8Linear for m in lins)
                and len({(m.grad_format, m.backend) for m in lins}) == 1)

    def qkv(self, x):
        """(x Wq^T, x Wk^T, x Wv^T), each [B, S, out_features]. FP8 projections: one fused
        fp8attn.linear.fp8_linear_fused call (x quantized once, one GEMM against
        [Wq; Wk; Wv] per pass; the three parameters stay separate), else three calls."""
        if self.fused_fp8_qkv():
            from fp8attn.linear import fp8_linear_fused   # noqa: PLC0415
            lins = (self.wq, self.wk, self.wv)
            return fp8_linear_fused(x, [m.weight for m in lins], [m.bias for m in lins],
                                    grad_format=self.wq.grad_format, backend=self.wq.backend)
        return self.wq(x), self.wk(x), self.wv(x)

    def forward(self, x, cos, sin, segments=None):
        b, s, _ = x.shape
        c = self.cfg
        pos = None if segments is None else segments[1]
        q, k, v = self.qkv(x)
        q = q.view(b, s, c.n_heads, c.head_dim).transpose(1, 2)
        k = k.view(b, s, c.n_kv_heads, c.head_dim).transpose(1, 2)
        v = v.view(b, s, c.n_kv_heads, c.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if c.rope:
            q, k = apply_rope(q, cos, sin, pos), apply_rope(k, cos, sin, pos)
        o = self.core(q, k, v, mode=c.attn_mode, layer_name=self.layer_name, block_size=c.fp8_block_size,
                      scaling=c.fp8_scaling, qk_rotation=c.fp8_qk_rotation, smooth_k=c.fp8_smooth_k,
                      grad_format=c.fp8_grad_format,
                      cu_seqlens=None if segments is None else segments[0],
                      positions=None if segments is None or segments[1] is None else segments[1][0])
        return self.wo(o.transpose(1, 2).reshape(b, s, c.n_heads * c.head_dim))


class GatedDeltaNet(nn.Module):
    """A Gated DeltaNet token mixer (Yang et al., "Gated Delta Networks", 2024) for the
    gdn-hybrid architecture: per head h, with L2-normalized q_t, k_t,
        S_t = a_t S_{t-1} (I - beta_t k_t k_t^T) + beta_t v_t k_t^T,   o_t = S_t q_t / sqrt(d),
    a_t = exp(g_t), g_t = -exp(A_log) softplus(x W_a + dt_bias), beta_t = sigmoid(x W_b);
    q, k, v from projections with a causal depthwise convolution (width 4) and SiLU; the
    output RMS-normalized per head, gated by silu(x W_g) and projected by W_o.
    The delta-rule recurrence is fla-core's: `chunk_gated_delta_rule` (Triton) on CUDA,
    its PyTorch reference `naive_chunk_gated_delta_rule` (chunk size 64, FP32) on the CPU
    and on GPUs where fla-core refuses its Triton backward (`_gdn_triton_refusal`).
    Heads: cfg.n_heads of cfg.head_dim (keys and values). No attention, no FP8."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, d = cfg.n_heads, cfg.head_dim
        self.h, self.d = h, d
        self.wq = nn.Linear(cfg.d_model, h * d, bias=False)
        self.wk = nn.Linear(cfg.d_model, h * d, bias=False)
        self.wv = nn.Linear(cfg.d_model, h * d, bias=False)
        self.wa = nn.Linear(cfg.d_model, h, bias=False)
        self.wb = nn.Linear(cfg.d_model, h, bias=False)
        self.wg = nn.Linear(cfg.d_model, h * d, bias=False)
        self.wo = nn.Linear(h * d, cfg.d_model, bias=False)
        self.conv = nn.Conv1d(3 * h * d, 3 * h * d, kernel_size=4, groups=3 * h * d, padding=3, bias=False)
        # Decay init as in the paper's code: A in [1, 16], dt in [1e-3, 1e-1] (log-uniform).
        gen = torch.Generator().manual_seed(0)
        self.A_log = nn.Parameter(torch.log(torch.empty(h).uniform_(1, 16, generator=gen)))
        dt = torch.exp(torch.empty(h).uniform_(math.log(1e-3), math.log(1e-1), generator=gen))
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))   # softplus^-1(dt)
        self.o_norm = RMSNorm(d)

    def forward(self, x):
        b, s, _ = x.shape
        qkv = torch.cat([self.wq(x), self.wk(x), self.wv(x)], dim=-1)
        qkv = F.silu(self.conv(qkv.transpose(1, 2))[..., :s].transpose(1, 2))
        q, k, v = (t.reshape(b, s, self.h, self.d) for t in qkv.chunk(3, dim=-1))
        q, k = F.normalize(q.float(), dim=-1), F.normalize(k.float(), dim=-1)
        g = -self.A_log.float().exp() * F.softplus(self.wa(x).float() + self.dt_bias.float())
        beta = torch.sigmoid(self.wb(x).float())
        if x.is_cuda and _gdn_triton_refusal() is None:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule
            # NOTE: one dtype for q, k, v, beta: v's, the convolution's output (BF16 under
            # autocast, where x, the RMSNorm output, is FP32): fla's Triton kernels
            # refuse mixed operands (tl.dot of an FP32 and a BF16 tile); g stays FP32.
            dt = v.dtype
            o, _ = chunk_gated_delta_rule(q.to(dt), k.to(dt), v, g, beta.to(dt))
        else:
            # NOTE: FP32 throughout (autocast would run the reference's matmuls in BF16 on CUDA).
            with torch.autocast(x.device.type, enabled=False):
                o, _ = _fla_naive()(q, k, v.float(), g, beta, chunk_size=64)
        o = self.o_norm(o.to(x.dtype)) * F.silu(self.wg(x)).view(b, s, self.h, self.d)
        return self.wo(o.reshape(b, s, self.h * self.d))


@functools.lru_cache(maxsize=None)
def _gdn_triton_refusal():
    """Why fla-core's Triton gated delta rule cannot train on this machine, or None.

    fla-core (0.6) refuses its Triton backward of the gated chunk on Hopper with Triton >= 3.4.0
    and < 3.7.1, which it says gives wrong results there (fla-core issue #640; without tilelang it
    raises in the backward). The H100 / H200 image has Triton 3.6.0, so there the mixer runs
    fla-core's PyTorch reference on the GPU instead (FP32, slower; the same math as on the CPU),
    saying so once."""
    why = None
    try:
        from fla.ops.common import chunk_o as co
        if (getattr(co, "IS_NVIDIA_HOPPER", False) and getattr(co, "TRITON_ABOVE_3_4_0", False)
                and not getattr(co, "TRITON_ABOVE_3_7_1", True)):
            try:
                import tilelang  # noqa: F401  (fla-core's alternative backend)
            except ImportError:
                import triton
                why = (f"fla-core refuses its Triton backward on Hopper with Triton {triton.__version__} "
                       "(>= 3.4.0, < 3.7.1: wrong results, fla-core issue #640)")
    except Exception as exc:  # noqa: BLE001 (any import failure: the reference still runs)
        why = f"fla-core's Triton kernels unavailable ({type(exc).__name__}: {str(exc)[:120]})"
    if why:
        print(f"[gdn] {why}: the Gated DeltaNet layers run fla-core's PyTorch reference on the GPU "
              "(FP32, slower)", flush=True)
    return why


def _fla_naive():
    """fla-core's PyTorch reference of the chunked gated delta rule (its CPU warning about
    Triton silenced: the reference does not use Triton)."""
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from fla.ops.gated_delta_rule.naive import naive_chunk_gated_delta_rule
    return naive_chunk_gated_delta_rule


def is_attention_layer(cfg: ModelConfig, idx: int) -> bool:
    """gqa: every layer; gdn-hybrid: every (gdn_ratio + 1)-th (the others Gated DeltaNet)."""
    return cfg.arch == "gqa" or idx % (cfg.gdn_ratio + 1) == cfg.gdn_ratio


class MLP(nn.Module):
    """SwiGLU: W2 (silu(x W1) * x W3)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.d_model, cfg.mlp_hidden, bias=False)
        self.w3 = nn.Linear(cfg.d_model, cfg.mlp_hidden, bias=False)
        self.w2 = nn.Linear(cfg.mlp_hidden, cfg.d_model, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, idx: int):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model)
        # gdn-hybrid: a Gated DeltaNet mixer instead of attention in this block (attn None).
        attn = is_attention_layer(cfg, idx)
        self.attn = Attention(cfg, layer_name=f"layer{idx}") if attn else None
        self.gdn = None if attn else GatedDeltaNet(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, segments=None):
        h = self.attn_norm(x)
        x = x + (self.attn(h, cos, sin, segments) if self.attn is not None else self.gdn(h))
        return x + self.mlp(self.mlp_norm(x))


def _recompute_every_op(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy
    return CheckpointPolicy.PREFER_RECOMPUTE


def checkpoint_block(fn, *args):
    """torch.utils.checkpoint(fn, *args, use_reentrant=False); under torch.compile through the
    selective-checkpoint path with a policy that recomputes every op, i.e. the same
    recomputation (the PREFER_RECOMPUTE tag plain checkpointing gives its ops).

    NOTE: torch 2.11 compiles plain checkpointing by tagging the ops of the checkpointed
    graph before the autograd.Functions in it (FP8Linear's _FP8LinearFn, fp8attn's attention)
    are inlined, so their ops carry no recompute tag and the partitioner saves their
    activations for backward as if the block were not checkpointed (gpu-1b fp8/
    attn-core+projections+ffn@tile compiled: CUDA OOM at 79 GB on an H100, 34.9 GB peak
    eager). The selective path tags every op as it is traced, those inside the
    autograd.Functions included (pytorch/pytorch PR 177396 moves plain checkpointing
    onto it). Eager keeps plain checkpointing (no per-op dispatch mode).
    Test: tests/python/test_presets.py::test_compiled_checkpointing_saves_no_more_than_eager."""
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts
    if torch.compiler.is_compiling():
        return checkpoint(fn, *args, use_reentrant=False,
                          context_fn=functools.partial(create_selective_checkpoint_contexts, _recompute_every_op))
    return checkpoint(fn, *args, use_reentrant=False)


class Transformer(nn.Module):
    """tokens int64 [B, S] -> logits [B, S, vocab] (causal LM)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model)
        self.head = None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        cos, sin = rope_tables(cfg.max_seq_len, cfg.head_dim, cfg.rope_base)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self._init_weights()
        self.fp8_linear_names = self._apply_scope()

    def _apply_scope(self) -> list:
        """Converts the scope's nn.Linear layers to FP8Linear (fp8 modes only, fp8-cudnn
        included: its row differs from the other fp8 modes in the attention core alone;
        same Parameter objects, so the init is untouched). Returns the converted names."""
        c = self.cfg
        if not c.attn_mode.startswith("fp8-") or c.scope == "attn-core":
            return []
        from fp8attn.linear import convert_to_fp8_linear
        return convert_to_fp8_linear(self, scope_linear_patterns(c.scope))

    def _init_weights(self):
        # Normal(0, init_std) for matrices (default 1/sqrt(d_model): with GPT-2's 0.02
        # a d_model-128 model learns visibly slower); residual output projections
        # scaled by 1/sqrt(2 n_layers) (GPT-2); norm gains start at 1.
        std = self.cfg.init_std or 1.0 / math.sqrt(self.cfg.d_model)
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                scale = 1.0 / math.sqrt(2 * self.cfg.n_layers) if name.endswith(("wo.weight", "w2.weight")) else 1.0
                nn.init.normal_(p, 0.0, std * scale)

    def with_attn_mode(self, mode: str) -> "Transformer":
        """Switches the attention backend in place (weights untouched); returns self.
        NOTE: the FP8 linear layers of `scope` are fixed at construction."""
        self.cfg = replace(self.cfg, attn_mode=mode)
        ref = next(self.parameters())
        for blk in self.blocks:
            if blk.attn is not None:
                blk.attn.cfg = self.cfg
                # NOTE: fp8-cudnn's per-layer scaling state: a fresh one when switching to it
                # (kept when already there), none in any other mode
                if mode != CUDNN_MODE:
                    blk.attn.core.cudnn_fp8 = None
                elif blk.attn.core.cudnn_fp8 is None:
                    blk.attn.core.cudnn_fp8 = cudnn_scaling_state(self.cfg).to(ref.device)
        return self

    cp: ContextParallel | None = None

    def _blocks(self, x, segments):
        """The blocks in order; with activation_checkpointing (and grad enabled) each block's
        activations are recomputed in backward (torch.utils.checkpoint, non-reentrant), so
        only the block inputs are saved. The recompute runs the same deterministic ops, so
        losses and gradients equal the unchecked model's (tests/python/test_presets.py)."""
        ckpt = self.cfg.activation_checkpointing and torch.is_grad_enabled()
        for blk in self.blocks:
            if ckpt:
                x = checkpoint_block(blk, x, self.rope_cos, self.rope_sin, segments)
            else:
                x = blk(x, self.rope_cos, self.rope_sin, segments)
        return x

    def set_context_parallel(self, cp_ctx: ContextParallel | None) -> "Transformer":
        """Context parallelism (None: off): forward then takes this rank's zigzag shard of
        the token rows ([B, seq_len / cp.world_size]); RoPE uses global positions and the
        attention cores the sharded backends (context_parallel_backend). Returns self."""
        if cp_ctx is not None and self.cfg.packed:
            raise ValueError("context parallelism: packed documents (packed=True) are not supported")
        if cp_ctx is not None and self.cfg.arch != "gqa":
            raise ValueError(f"context parallelism: arch {self.cfg.arch!r} is not supported (the Gated "
                             "DeltaNet recurrence would need its state passed between shards)")
        self.cp = cp_ctx
        for blk in self.blocks:
            if blk.attn is not None:
                blk.attn.core.cp = cp_ctx
        return self

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        s = tokens.shape[1]
        if self.cp is not None:
            s_all = s * self.cp.world_size
            if s_all > self.cfg.max_seq_len:
                raise ValueError(f"tokens: seqlen {s_all} ({s} per rank) exceeds max_seq_len {self.cfg.max_seq_len}")
            pos = self.cp.positions(s_all, tokens.device)
            x = self.embed(tokens)
            segments = (None, pos.expand(tokens.shape[0], s))
            x = self._blocks(x, segments)
            x = self.norm(x)
            w = self.embed.weight if self.head is None else self.head.weight
            return F.linear(x, w.to(x.dtype))
        if s > self.cfg.max_seq_len:
            raise ValueError(f"tokens: seqlen {s} exceeds max_seq_len {self.cfg.max_seq_len}")
        x = self.embed(tokens)
        segments = document_segments(tokens) if self.cfg.packed else None
        x = self._blocks(x, segments)
        x = self.norm(x)
        w = self.embed.weight if self.head is None else self.head.weight
        return F.linear(x, w.to(x.dtype))

    def qk_gains(self):
        """[(layer_name, g_q [D], g_k [D])] for every attention layer with QK-norm."""
        return [(b.attn.layer_name, b.attn.q_norm.weight, b.attn.k_norm.weight)
                for b in self.blocks if b.attn is not None and b.attn.q_norm is not None]

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


def gain_stats(g_q: torch.Tensor, g_k: torch.Tensor, top_k: int = 4) -> tuple[float, float]:
    """QK-norm channel gain statistics (numerics.md section 5).

    g_q, g_k: per-channel gains, same shape (any shape; flattened, so gains kept
    per head [H, D] are treated as H*D channels). Returns
      max_gain  = max_c max(|g_q[c]|, |g_k[c]|)
      top_share = (sum of the top_k largest (g_q[c] g_k[c])^2) / sum_c (g_q[c] g_k[c])^2
    (top_share is 0 for all-zero gains).
    """
    if g_q.shape != g_k.shape:
        raise ValueError(f"g_q and g_k must have the same shape, got {tuple(g_q.shape)} and {tuple(g_k.shape)}")
    gq, gk = g_q.detach().double().flatten(), g_k.detach().double().flatten()
    max_gain = float(torch.maximum(gq.abs().max(), gk.abs().max()))
    e = (gq * gk) ** 2
    total = float(e.sum())
    top = float(e.topk(min(top_k, e.numel())).values.sum())
    return max_gain, (top / total if total > 0 else 0.0)


# ----------------------------------------------------------------------------
# Presets
# ----------------------------------------------------------------------------

PRESETS: dict[str, dict] = {
    # Seconds-scale smoke test (tests/python/test_train.py); tiny vocab for tiny corpora.
    "smoke": dict(model=dict(vocab_size=512, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                             head_dim=32, mlp_hidden=192, max_seq_len=64),
                  train=dict(batch_size=8, seq_len=64, steps=20, lr=1e-2, warmup=2)),
    # ~1.3 M params (0.5 M of them the tied 4096-token embedding); 300 steps of all four
    # modes take ~4-5 min on 2 idle CPU cores (the fp8 modes run the CPU reference op).
    "cpu-tiny": dict(model=dict(vocab_size=4096, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2,
                                head_dim=32, mlp_hidden=384, max_seq_len=128),
                     train=dict(batch_size=8, seq_len=128, steps=300, lr=1e-2, warmup=30)),
    # ~49 M params (16384 vocab, tied). The linux-doc corpus is ~7 M tokens at this
    # vocab, so 1200 steps x 16 x 1024 tokens is ~3 epochs.
    "gpu-50m": dict(model=dict(vocab_size=16384, d_model=512, n_layers=12, n_heads=8, n_kv_heads=2,
                               head_dim=64, mlp_hidden=1792, max_seq_len=1024),
                    train=dict(batch_size=16, seq_len=1024, steps=1200, lr=1.5e-3, warmup=120)),
    # ~123 M params (16384 vocab, tied), head_dim 128.
    "gpu-125m": dict(model=dict(vocab_size=16384, d_model=768, n_layers=16, n_heads=6, n_kv_heads=2,
                                head_dim=128, mlp_hidden=2304, max_seq_len=1024),
                     train=dict(batch_size=16, seq_len=1024, steps=1500, lr=1e-3, warmup=150)),
    # The sizes where users switch to FP8 (issue #21): 32K vocab, untied, QK-RMSNorm,
    # head_dim 128, GQA 4:1, contexts of 4K-8K. gpu-350m: 337.7 M parameters (24 layers
    # of 11.27 M + 2 x 33.55 M embedding / head); at 8 x 4096 tokens its activations fit
    # an H200 without checkpointing (~34 GB estimated for BF16 activations).
    "gpu-350m": dict(model=dict(vocab_size=32768, d_model=1024, n_layers=24, n_heads=8, n_kv_heads=2,
                                head_dim=128, mlp_hidden=2816, max_seq_len=8192, tie_embeddings=False),
                     train=dict(batch_size=8, seq_len=4096, steps=2000, lr=6e-4, warmup=200)),
    # gpu-1b: 1216.5 M parameters (24 layers of 45.09 M + 2 x 67.1 M). At 4 x 8192 tokens
    # the block activations (~5.6 GB per layer estimated, ~135 GB for 24) exceed an
    # H200 next to the 19.5 GB of FP32 weights, gradients and AdamW state, so activation
    # checkpointing is on (block inputs only: ~3.2 GB).
    "gpu-1b": dict(model=dict(vocab_size=32768, d_model=2048, n_layers=24, n_heads=16, n_kv_heads=4,
                              head_dim=128, mlp_hidden=5632, max_seq_len=8192, tie_embeddings=False,
                              activation_checkpointing=True),
                   train=dict(batch_size=4, seq_len=8192, steps=1000, lr=3e-4, warmup=100)),
}


def preset_model_config(preset: str, **overrides) -> ModelConfig:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    return ModelConfig(**{**PRESETS[preset]["model"], **overrides})
