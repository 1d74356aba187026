"""No autograd.Function forward of the package returns a bare `.to(dtype)`.

Under torch.compile (torch 2.11, every backend) a Function forward that returned
t.to(dtype) where that is a no-op (an alias of t) gave all-zero gradients for its inputs,
silently: attention with smooth_k and FP8Linear with float32 inputs (a break test,
2026-12-03; the compiled-vs-eager tests in test_qk_transform.py and test_linear.py show
both). The forwards return ops.as_dtype(t, dtype) instead; this static check keeps a new
Function (or a new return) from bringing the pattern back. CPU, < 1 s."""
from __future__ import annotations

import ast
from pathlib import Path

import torch

PKG = Path(__file__).resolve().parents[2] / "python" / "fp8attn"


def _is_to_call(node) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "to"


def _function_forwards():
    for path in sorted(PKG.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for cls in ast.walk(tree):
            if not isinstance(cls, ast.ClassDef):
                continue
            if not any(ast.unparse(b).endswith("autograd.Function") for b in cls.bases):
                continue
            for fn in cls.body:
                if isinstance(fn, ast.FunctionDef) and fn.name == "forward":
                    yield f"{path.relative_to(PKG)}:{cls.name}", fn


def bare_to_returns(fn: ast.FunctionDef) -> list[str]:
    """Returned expressions of fn that are x.to(...) calls, directly, in a returned tuple,
    or through a name last assigned from one."""
    assigned = {}
    for node in ast.walk(fn):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            assigned[node.targets[0].id] = node.value
    bad = []
    for node in ast.walk(fn):
        if isinstance(node, ast.Return) and node.value is not None:
            parts = node.value.elts if isinstance(node.value, ast.Tuple) else [node.value]
            for p in parts:
                src = assigned.get(p.id) if isinstance(p, ast.Name) else p
                if src is not None and _is_to_call(src):
                    bad.append(ast.unparse(p))
    return bad


def test_no_function_forward_returns_a_bare_to():
    found = dict(_function_forwards())
    # The Functions this guards (a rename or a move must not make the check vacuous).
    for name in ("ops.py:_AttentionFunction", "linear.py:_FP8LinearFn", "context_parallel.py:_RingAttention"):
        assert name in found, sorted(found)
    offenders = {name: bad for name, fn in found.items() if (bad := bare_to_returns(fn))}
    assert not offenders, offenders


def test_the_check_sees_the_pattern():
    """The failure it guards against, in the two forms the package had."""
    direct = ast.parse("def forward(ctx, x):\n    y = x * 2\n    return y.to(torch.float32)\n").body[0]
    named = ast.parse("def forward(ctx, q):\n    o = q + 1\n    out = o.to(q.dtype)\n    return out, o\n").body[0]
    fixed = ast.parse("def forward(ctx, x):\n    y = x * 2\n    return as_dtype(y, torch.float32)\n").body[0]
    assert bare_to_returns(direct) == ["y.to(torch.float32)"]
    assert bare_to_returns(named) == ["out"]
    assert bare_to_returns(fixed) == []
    # And the alias itself: .to() of the same dtype returns the very tensor.
    t = torch.ones(2)
    assert t.to(torch.float32) is t
