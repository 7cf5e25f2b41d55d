"""What every op of the torch.ops.flexdma family shares on the Python side: the autograd of an
attention forward op (`register_autograd`, and `eager_autograd`, the form eager calls take), the
fake outputs' shapes, and the test for a plain eager call. Each path registers its ops' fake
kernels and autograd with these: flexdma/dense/ops.py (fwd, bwd, tile_meta) and
flexdma/perkey/ops.py (perkey_select, perkey_fwd, perkey_bwd and the Triton implementation's).

The schemas and the CPU/CUDA kernels are registered by the C++ extension (ops/). Every op takes
a padded call (q (B, Q, H, D)) or, given cu_seqlens_q / cu_seqlens_k, a packed one (q (Tq, H, D),
FlashAttention's varlen layout, lse (H, Tq)): the same op in either form. Without the extension
(flexdma._ext.C is None) nothing is registered.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch

from . import _ext

__all__ = ["register_autograd", "eager_autograd", "grads_like", "out_like"]

LOADED = _ext.LOAD_ERROR is None


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def keeps_residual(q) -> bool:
    # The CUDA kernels return out rounded and its rounding error (see the schemas' comments).
    return q.device.type == "cuda"


def out_like(q, keep_resid: bool = True) -> tuple:
    """The fake outputs of every forward op: out like q, lse (B, H, Q) of a padded call or (H, Tq)
    of a packed one (q (Tq, H, D)) in the accumulation dtype, and out_resid like q where the
    kernels return it (else empty)."""
    if q.dim() == 3:  # packed
        lse = q.new_empty((q.shape[1], q.shape[0]), dtype=acc_dtype(q.dtype))
    else:
        B, Q, H, _ = q.shape
        lse = q.new_empty((B, H, Q), dtype=acc_dtype(q.dtype))
    resid = q.new_empty(q.shape) if keep_resid and keeps_residual(q) else q.new_empty((0,))
    return q.new_empty(q.shape), lse, resid


def grads_like(q, k, v, attn_bias, bias_requires_grad: bool) -> tuple:
    """The fake outputs of every backward op: (dq, dk, dv) like q, k, v, and dbias like the bias
    where it gets a gradient, else an empty tensor."""
    want = bias_requires_grad and attn_bias is not None
    dbias = attn_bias.new_empty(attn_bias.shape) if want else q.new_empty((0,))
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dbias


class Direct(NamedTuple):
    """The device implementations of a forward op and its backward op, for eager calls to run
    without the dispatcher's hop into a Python-registered kernel: `takes(args)` says whether a
    call's operands go where the dispatcher would send them (`fwd`), its backward then to `bwd`."""

    takes: Callable
    fwd: Callable
    bwd: Callable


def plain_eager(tensors) -> bool:
    """No torch.compile tracing, dispatch or function mode, functorch transform or tensor subclass
    between an eager call and the kernels: the dispatcher would pick the tensors' device kernel."""
    return (
        not torch.compiler.is_compiling()  # first: torch.compile cannot trace the checks below
        and torch._C._len_torch_dispatch_stack() == 0
        and not torch._C._is_torch_function_mode_enabled()
        and not torch._C._are_functorch_transforms_active()
        and all(type(t) in _PLAIN for t in tensors)
    )


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def register_autograd(
    fwd_name: str,
    call_bwd,
    n_tensors: int,
    bias_index: int,
    direct: Optional[Direct] = None,
    bwd_extra: Optional[slice] = None,
):
    """Autograd of an attention forward op whose inputs are `n_tensors` tensors (q, k, v first, the
    bias at `bias_index`), then softmax_scale, is_causal, softcap, deterministic and the tile tensor
    the forward read (and maybe more), and whose outputs are (out, lse, out_resid); its backward is
    `call_bwd(grad_out, *tensors, out, lse, softmax_scale, is_causal, softcap, bias_requires_grad,
    deterministic, tiles, out_resid, *extra)` -> (dq, dk, dv, dbias), `extra` the forward's
    inputs[bwd_extra] (as many as the call passed). The dense fwd and the per-key perkey_fwd (whose
    extra are the packed form's offsets and lengths) and the per-key Triton implementation (whose
    extra is the lists' tile rows) have this form. Returns the op as
    the API calls it (`eager_autograd`), through `direct`'s implementations where it takes the call."""

    def setup_context(ctx, inputs, output):
        tensors = inputs[:n_tensors]
        softmax_scale, is_causal, softcap, deterministic, tiles = inputs[n_tensors : n_tensors + 5]
        out, lse, resid = output
        # The forward's tile bits / lists serve the backward too: one pass over the mask per step.
        extra = tuple(inputs[bwd_extra]) if bwd_extra is not None else ()
        # Tensors among the extra inputs (a packed call's offsets) are saved as tensors are.
        ctx.extra_at = tuple(i for i, e in enumerate(extra) if isinstance(e, torch.Tensor))
        ctx.save_for_backward(*tensors, out, lse, tiles, resid, *(extra[i] for i in ctx.extra_at))
        ctx.cfg = (softmax_scale, is_causal, softcap)
        ctx.deterministic = deterministic
        ctx.extra = tuple(None if isinstance(e, torch.Tensor) else e for e in extra)
        ctx.n_inputs = len(inputs)
        # LSE is an output for inspection (and for merging partial results), not a differentiable
        # one; out_resid only feeds the backward's row sums.
        ctx.mark_non_differentiable(lse, resid)
        # Their gradients stay None instead of zero tensors the engine would fill every backward
        # (one of them out's size).
        ctx.set_materialize_grads(False)

    def backward(ctx, grad_out, grad_lse, grad_resid):
        if grad_out is None:  # out did not reach what is differentiated: no input gets a gradient
            return (None,) * ctx.n_inputs
        saved = ctx.saved_tensors
        *tensors, out, lse, tiles, resid = saved[: n_tensors + 4]
        extra = ctx.extra
        if ctx.extra_at:
            extra = list(extra)
            for i, t in zip(ctx.extra_at, saved[n_tensors + 4 :]):
                extra[i] = t
        bias_grad = tensors[bias_index] is not None and ctx.needs_input_grad[bias_index]
        if grad_out.stride(-1) != 1:
            # clone, not contiguous(): an empty grad_out (seqlen_q = 0, e.g. from out.sum()) counts
            # as contiguous whatever its strides, and the kernels check head_dim's stride.
            grad_out = grad_out.clone(memory_format=torch.contiguous_format)
        args = (grad_out, *tensors, out, lse, *ctx.cfg, bias_grad, ctx.deterministic, tiles, resid, *extra)
        # The eager forward's direct implementation has its backward's, where no graph of the
        # backward is built (the op's autograd refuses double backward) and nothing came between
        # since the forward (a mode the backward alone runs under sees the op).
        bwd = getattr(ctx, "direct_bwd", None)
        if bwd is not None and not torch.is_grad_enabled() and plain_eager((grad_out,)):
            dq, dk, dv, dbias = bwd(*args)
        else:
            dq, dk, dv, dbias = below_autograd(call_bwd, *args)
        grads = [None] * ctx.n_inputs
        grads[0:3] = dq, dk, dv
        grads[bias_index] = dbias if bias_grad else None
        return tuple(grads)

    torch.library.register_autograd(fwd_name, backward, setup_context=setup_context)
    namespace, name = fwd_name.split("::")
    return eager_autograd(getattr(getattr(torch.ops, namespace), name), setup_context, backward, direct)


def eager_autograd(op, setup_context, backward, direct: Optional[Direct] = None):
    """`op` (whose autograd torch.library registered from setup_context / backward) as the API calls
    it: in eager mode where a gradient is wanted, one autograd.Function of the same setup_context
    and backward around the op called below the autograd key; elsewhere (torch.compile and
    torch.export tracing, no gradient) the op itself. Same gradients, without the generic wrapper's
    per-call work (filling the schema's defaults, a Python redispatch: half the host time of a
    forward op on small inputs), which the host-bound short calls pay on every step. With `direct`,
    the calls it takes run its implementations (the backward too) instead of the ops'."""

    # ctx in forward (not a separate setup_context): apply then binds no signature per call.
    class Function(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *args):
            fn = op
            if direct is not None and direct.takes(args):
                fn, ctx.direct_bwd = direct.fwd, direct.bwd
            with torch._C._AutoDispatchBelowAutograd():
                output = fn(*args)
            setup_context(ctx, args, output)
            return output

        @staticmethod
        def backward(ctx, *grads):
            return backward(ctx, *grads)

    Function.__name__ = f"{op._qualified_op_name.replace('::', '_')}_eager"

    def call(*args):
        if torch.compiler.is_compiling():  # traced: the op, whose autograd torch.compile sees
            return op(*args)
        if torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            return Function.apply(*args)
        if direct is not None and direct.takes(args):
            return direct.fwd(*args)
        # No gradient: the op's autograd kernel would only redispatch below itself, through the
        # generic wrapper's Python (about as long as the rest of a small forward op's host time).
        with torch._C._AutoDispatchBelowAutograd():
            return op(*args)

    return call


def below_autograd(fn, *args):
    """fn(*args) (a backward op call inside a backward) below the autograd key where no graph of the
    backward is being built: the op's own autograd only refuses double backward, and its generic
    wrapper costs host time on every step."""
    if torch.is_grad_enabled():  # create_graph=True: the backward op's autograd refuses it
        return fn(*args)
    with torch._C._AutoDispatchBelowAutograd():
        return fn(*args)


def no_double_backward(ctx, *grads):
    raise NotImplementedError("flexdma: double backward (gradients of gradients) is not supported")


def forbid_double_backward(bwd_name: str) -> None:
    # Without this, differentiating through a backward op would silently give zero second derivatives.
    torch.library.register_autograd(bwd_name, no_double_backward, setup_context=lambda ctx, inputs, output: None)
