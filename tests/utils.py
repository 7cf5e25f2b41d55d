"""Shared test utilities: random inputs, mask/bias generators for every broadcast pattern, the
FlashAttention tolerance rule against the float64 reference, and output poisoning."""

from __future__ import annotations

import itertools
from typing import Dict, Optional, Sequence, Tuple

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import flexdma  # noqa: F401  (registers torch.ops.flexdma)
from flexdma.dense.naive import attention_ref

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# Dims of a mask / bias: batch {1|B}, heads {1|KVH|H}, query {1|Q}, key {1|K}.
BATCH_DIMS = ("1", "B")
HEAD_DIMS = ("1", "KVH", "H")
QUERY_DIMS = ("1", "Q")
KEY_DIMS = ("1", "K")
ALL_PATTERNS: Tuple[Tuple[str, str, str, str], ...] = tuple(
    itertools.product(BATCH_DIMS, HEAD_DIMS, QUERY_DIMS, KEY_DIMS)
)


def pattern_id(pattern: Optional[Sequence[str]]) -> str:
    return "none" if pattern is None else "x".join(pattern)


def pattern_shape(pattern: Sequence[str], *, B: int, H: int, KVH: int, Q: int, K: int) -> Tuple[int, ...]:
    sizes = {"1": 1, "B": B, "H": H, "KVH": KVH, "Q": Q, "K": K}
    return tuple(sizes[p] for p in pattern)


def make_qkv(B, Q, K, H, KVH, D, *, dtype=torch.float32, device="cpu", requires_grad=False):
    """Random q (B, Q, H, D), k/v (B, K, KVH, D) from the test's seeded global generator."""
    q = torch.randn(B, Q, H, D, dtype=torch.float32).to(device=device, dtype=dtype)
    k = torch.randn(B, K, KVH, D, dtype=torch.float32).to(device=device, dtype=dtype)
    v = torch.randn(B, K, KVH, D, dtype=torch.float32).to(device=device, dtype=dtype)
    return tuple(t.requires_grad_(requires_grad) for t in (q, k, v))


def make_mask_bias(
    mask_pattern,
    bias_pattern,
    *,
    B,
    H,
    KVH,
    Q,
    K,
    dtype=torch.float32,
    device="cpu",
    density: float = 0.6,
    empty_rows: bool = False,
    bias_requires_grad: bool = False,
    bias_scale: float = 2.0,
):
    """(mask or None, bias or None) with the given broadcast patterns (see ALL_PATTERNS).

    Every mask row keeps at least one key, unless empty_rows: then a few query rows of the first
    batch / head entry drop every key (other entries keep content). A mask with key dim 1 keeps
    or drops whole rows at random either way.
    """
    mask = bias = None
    if mask_pattern is not None:
        shape = pattern_shape(mask_pattern, B=B, H=H, KVH=KVH, Q=Q, K=K)
        mask = torch.rand(shape) < density
        if shape[3] > 1:
            # Keep at least one key per row unless the test asks for empty rows.
            keep = torch.randint(0, shape[3], shape[:3] + (1,))
            mask.scatter_(3, keep, True)
        if empty_rows:
            rows = sorted({0, shape[2] // 2, shape[2] - 1}) if shape[2] > 1 else [0]
            mask[0, 0, rows, :] = False
        mask = mask.to(device)
    if bias_pattern is not None:
        shape = pattern_shape(bias_pattern, B=B, H=H, KVH=KVH, Q=Q, K=K)
        bias = (torch.randn(shape) * bias_scale).to(device=device, dtype=dtype)
        bias.requires_grad_(bias_requires_grad)
    return mask, bias


# ------------------------------------------------------------------------------ tolerances
def _finite_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double(), ref.double()
    both = torch.isfinite(ref)
    if not both.any():
        return 0.0
    return (x[both] - ref[both]).abs().max().item()


def check_same_nonfinite(x: torch.Tensor, ref: torch.Tensor, name: str) -> None:
    x, ref = x.detach().cpu(), ref.detach().cpu()
    assert not torch.isnan(x).any(), f"{name}: NaN in result"
    fin = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(x), fin), f"{name}: non-finite entries differ from the reference"
    assert torch.equal(x[~fin].double(), ref[~fin].double()), f"{name}: infinities differ from the reference"


FP32_RTOL = 1e-4


def rounding_floor(ref: torch.Tensor, dtype: torch.dtype) -> float:
    """FlashAttention-3's absolute floor: twice the rounding error of `dtype` at the reference's
    scale (at least 0.3), i.e. about two units in the last place of the largest value."""
    # The 0.3 term alone: exactly-zero references (a gradient that vanishes, e.g. of a bias
    # broadcast over keys) still get the rounding of a 0.3-sized value.
    at_03 = torch.finfo(dtype).eps / 4
    r = ref[torch.isfinite(ref)].to(dtype)
    if r.numel() == 0:
        return at_03
    return max(at_03, 2 * (r + 0.3 - 0.3 - r).abs().max().item())


def assert_close_to_ref(
    out: torch.Tensor, out_ref: torch.Tensor, out_ref_lowp: Optional[torch.Tensor], name: str, *, factor: float = 2.0
) -> None:
    """FlashAttention's rule: |out - ref64| <= factor * |ref_lowp - ref64| + floor (max norms).

    out_ref is the float64 reference; out_ref_lowp the same computation run in out's dtype, and
    floor is rounding_floor (FlashAttention-3 uses factor 3 with softcap). For float32 / float64
    inputs (out_ref_lowp None or not low precision) a fixed tolerance relative to the reference's
    magnitude is used instead. Non-finite entries (lse -inf) must match exactly.
    """
    assert out.shape == out_ref.shape, f"{name}: shape {tuple(out.shape)} != reference {tuple(out_ref.shape)}"
    out, out_ref = out.detach().cpu(), out_ref.detach().cpu()
    check_same_nonfinite(out, out_ref, name)
    err = _finite_err(out, out_ref)
    fin = out_ref[torch.isfinite(out_ref)]
    scale = fin.abs().max().item() if fin.numel() else 0.0
    if out_ref_lowp is None or out_ref_lowp.dtype not in (torch.float16, torch.bfloat16):
        tol = FP32_RTOL * (1.0 + scale)
        assert err <= tol, f"{name}: max error {err:.3e} > {tol:.3e} (float32 tolerance, |ref| max {scale:.3e})"
        return
    ref_err = _finite_err(out_ref_lowp.detach().cpu(), out_ref)
    floor = rounding_floor(out_ref, out_ref_lowp.dtype)
    tol = factor * ref_err + floor
    assert err <= tol, (
        f"{name}: max error {err:.3e} > {factor} x reference {out_ref_lowp.dtype} error "
        f"{ref_err:.3e} + floor {floor:.3e} (|ref| max {scale:.3e})"
    )


def reference_with_grads(q, k, v, mask, bias, grad_out, *, dtype, bias_grad: bool, **kw) -> Dict[str, torch.Tensor]:
    """attention_ref run in `dtype` on copies of the inputs: out, lse, dq, dk, dv (dbias)."""

    def leaf(t):
        return t.detach().to(dtype).requires_grad_(True)

    qr, kr, vr = leaf(q), leaf(k), leaf(v)
    br = None if bias is None else (leaf(bias) if bias_grad else bias.detach().to(dtype))
    out, lse = attention_ref(qr, kr, vr, mask, br, **kw)
    inputs = [qr, kr, vr] + ([br] if bias_grad else [])
    grads = torch.autograd.grad(out, inputs, grad_out.to(dtype))
    res = dict(out=out.detach(), lse=lse.detach(), dq=grads[0], dk=grads[1], dv=grads[2])
    if bias_grad:
        res["dbias"] = grads[3]
    return res


# ------------------------------------------------------------------------------ poisoning
def poison_allocator(like: Sequence[torch.Tensor]) -> None:
    """Allocate and free NaN-filled blocks the size of the coming outputs, so that an allocator
    that reuses memory (the CUDA caching allocator; small CPU allocations) hands the kernel
    poisoned buffers: an element the kernel forgets to write then shows up as NaN."""
    blocks = [torch.full_like(t, float("nan")) for t in like if t.is_floating_point()]
    del blocks


def assert_no_nan(name: str, t: torch.Tensor) -> None:
    bad = torch.isnan(t.detach())
    assert not bad.any(), f"{name}: {int(bad.sum())} NaN element(s) (unwritten or invalid)"


# ------------------------------------------------------------------------------ CUDA graphs
def assert_graph_replays(call, inputs, n_leaves: int) -> None:
    """A training call `call(*inputs(seed))` -> (out, *grads), its first n_leaves inputs the leaves,
    captured in one CUDA graph (so nothing in it waits on the host), replayed on the values of two
    other seeds against eager calls on them: out equal, the gradients (float sums by atomics) equal
    up to the order of the adds. The outputs are poisoned before each replay: it must write every
    element."""
    static = [t.clone().requires_grad_(i < n_leaves) for i, t in enumerate(inputs(0))]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            call(*static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = call(*static)
    for seed in (1, 2):
        fresh = inputs(seed)
        with torch.no_grad():
            for dst, src in zip(static, fresh):
                dst.copy_(src)
        for o in outs:
            o.fill_(float("nan"))
        graph.replay()
        want = call(*[t.clone().requires_grad_(i < n_leaves) for i, t in enumerate(fresh)])
        assert torch.equal(outs[0], want[0])
        for got, ref in zip(outs[1:], want[1:]):
            assert not got.isnan().any()
            torch.testing.assert_close(got, ref, atol=2e-2, rtol=2e-2)


# ------------------------------------------------------------------------------ memory
class LargestTensor(TorchDispatchMode):
    """Records the largest tensor any op creates inside the `with` block (numel and bytes)."""

    def __init__(self):
        super().__init__()
        self.largest = self.nbytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
                self.nbytes = max(self.nbytes, t.numel() * t.element_size())
        return out
