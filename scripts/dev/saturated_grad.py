"""Gradients of Doge's dynamic mask attention where the bias is huge, against float64 truth.

The bias exp(A * softplus(v_flat @ dt_proj^T)) reaches 1e6-1e12 once A > 0: many softmax rows
saturate (one kept key takes all the probability, and the true dS of the row is 0), and the bias's
own gradient multiplies dS by the bias on its way to dt_proj, A and v. Whatever rounding a kernel
leaves in dS there is amplified by the bias; dq, dk (and the attention's own dv) are not.

For each configuration and dtype this prints, per gradient (dq, dk, dv, d dt_proj, dA), the largest
entry of the float64 truth, flexdma's error (flexdma.dynamic_mask_attention on `--backend`), the
error of the same eager computation run in that dtype, and whether FlashAttention's rule holds:
error <= 2 x the eager computation's error + a floor of two units in the last place at the truth's
largest entry (tests/utils.py's rule; for float32, 1e-4 x (1 + the largest entry)). Truth and the low-precision computation take the inputs
rounded to the dtype, so only the arithmetic differs. float16 cannot hold a bias above 65504: those
rows report the non-finite values.

On the GPU machine, from the repository root:
    python -m scripts.dev.saturated_grad [--out results.json]
(`--device cpu --dtypes float32 --backend cpu` runs the CPU kernel the same way.)
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

import flexdma

# (name, torch.manual_seed, B, H, L, D, keep_window_size, A): the seed's gradient benchmark (its
# manual_seed(42) draws A = 1.14) and larger shapes with A fixed.
CONFIGS = [
    ("seed-1x1x64x64x64", 42, 1, 1, 64, 64, 32, None),
    ("1x1x64x64x64-A1", 2, 1, 1, 64, 64, 32, 1.0),
    ("2x2x1024x1024x128-A0.5", 0, 2, 2, 1024, 128, 256, 0.5),
    ("2x2x1024x1024x128-A1", 0, 2, 2, 1024, 128, 256, 1.0),
]
GRADS = ("dq", "dk", "dv", "d dt_proj", "dA")


def eager_doge(q, k, v, dt_proj, A, *, scale, window):
    """The attention in eager PyTorch, (B, H, L, D) layout: the per-key bias
    exp(A * softplus(v_flat @ dt_proj^T)), each row keeping its `window` best keys under the causal
    cut, softmax(q.k * scale + bias) over them. tests/dense/test_cpu_precision.py compares the CPU
    kernel with it in float32."""
    B, H, L, D = q.shape
    x = v.transpose(1, 2).reshape(B, L, H * D) @ dt_proj.T
    bias = torch.exp(A * F.softplus(x)).transpose(1, 2)[:, :, None, :]
    causal = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
    ranked = bias.expand(B, H, L, L).masked_fill(~causal, float("-inf"))
    keep = torch.zeros(B, H, L, L, dtype=torch.bool, device=q.device)
    keep = keep.scatter(-1, ranked.topk(window, dim=-1).indices, True) & causal
    logits = (q @ k.transpose(-1, -2) * scale + bias).masked_fill(~keep, float("-inf"))
    return torch.softmax(logits, dim=-1) @ v


def grads(inputs, dtype, fn):
    leaves = [t.to(dtype).requires_grad_() for t in inputs]
    out = fn(*leaves)
    return [g.double() for g in torch.autograd.grad(out.float().sum(), leaves)], out.double()


def floor(ref, dtype):
    """Two units in the last place of `dtype` at the reference's largest entry (at least 0.3's)."""
    m = max(ref.abs().max().item(), 0.3)
    return 2 * torch.finfo(dtype).eps * m


def run(config, dtype, device, backend):
    name, seed, B, H, L, D, W, A = config
    torch.manual_seed(seed)
    q, k, v = (torch.randn(B, H, L, D) for _ in range(3))
    dt_proj = torch.randn(H, H * D)
    A = torch.randn(H) if A is None else torch.full((H,), A)
    # The inputs rounded to the dtype once: truth and both low-precision runs start from them.
    inputs = [t.to(dtype).to(device) for t in (q, k, v, dt_proj, A)]
    scale = D**-0.5

    def kernel(q, k, v, dt_proj, A):
        qs, ks, vs = (t.transpose(1, 2) for t in (q, k, v))
        return flexdma.dynamic_mask_attention(
            qs, ks, vs, dt_proj, A, keep_window_size=W, is_causal=True, softmax_scale=scale, backend=backend
        ).transpose(1, 2)

    def eager(*ins):
        return eager_doge(*ins, scale=scale, window=W)

    truth, _ = grads(inputs, torch.float64, eager)
    got, _ = grads(inputs, dtype, kernel)
    low, _ = grads(inputs, dtype, eager)
    with torch.no_grad():
        x = inputs[2].double().transpose(1, 2).reshape(B, L, H * D) @ inputs[3].double().T
        max_bias = torch.exp(inputs[4].double() * F.softplus(x)).max().item()
    rows = []
    for g, t, lo, gname in zip(got, truth, low, GRADS):
        size = t.abs().max().item()
        err = (g - t).abs().max().item() if torch.isfinite(g).all() else float("nan")
        err_low = (lo - t).abs().max().item() if torch.isfinite(lo).all() else float("nan")
        # bf16 / fp16: FlashAttention's rule; float32 / float64: tests/utils.py's relative tolerance.
        lowp = dtype in (torch.bfloat16, torch.float16)
        tol = 2 * err_low + floor(t, dtype) if lowp else 1e-4 * (1 + size)
        rows.append(
            dict(
                config=name,
                dtype=str(dtype).replace("torch.", ""),
                backend=backend,
                A=inputs[4].double().max().item(),
                max_bias=max_bias,
                grad=gname,
                truth_max=size,
                err=err,
                err_eager_lowp=err_low,
                rule_ok=bool(err <= tol),
                nonfinite=int((~torch.isfinite(g)).sum()),
            )
        )
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtypes", default="bfloat16,float16")
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("saturated_grad: skipped, no CUDA device")
        return
    rows = []
    print(
        f"{'config':24s} {'dtype':9s} {'max bias':>9s} {'grad':10s} {'|truth|':>9s} {'err':>9s} {'eager err':>9s}  rule"
    )
    for config in CONFIGS:
        for dt in args.dtypes.split(","):
            for r in run(config, getattr(torch, dt), args.device, args.backend):
                rows.append(r)
                print(
                    f"{r['config']:24s} {r['dtype']:9s} {r['max_bias']:9.1e} {r['grad']:10s} {r['truth_max']:9.2e} "
                    f"{r['err']:9.2e} {r['err_eager_lowp']:9.2e}  {'ok' if r['rule_ok'] else 'OVER'}"
                    + (f"  ({r['nonfinite']} non-finite)" if r["nonfinite"] else "")
                )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
