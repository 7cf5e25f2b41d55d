"""flexdma's FlexAttention path at the seed's shape (32K, per-row bias, top-1024 mask) against a
hand-written compiled flex_attention: BlockMask build time (and the Triton tile kernel's configs),
forward times, the cross terms (hand-written call with our BlockMask), a profiler table of our
forward, then backward times. Lines starting with '==' are the results; the rest is detail.
Ordered cheapest first so that a timeout still leaves the forward numbers.

python -m scripts.dev.flex_probe (from the repository root)"""

import time

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
from torch.profiler import ProfilerActivity, profile
from triton.testing import do_bench

from flexdma.dense import _block_tiles, flex  # noqa: E402
from scripts.dev.flex_check import build_inputs  # noqa: E402

T0 = time.time()


def say(msg):
    print(f"== [{time.time() - T0:5.1f}s] {msg}", flush=True)


def table(fn, n=3):
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60)


def main():
    Q = K = 32768
    q, k, v, bias, mask = build_inputs(Q, K, 1024)
    scale = 128**-0.5
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))

    def hand_mod(b, h, qi, ki):
        return mask[0, 0, qi, ki] & (ki <= qi)

    def score_mod(s, bb, h, qi, ki):
        return s + bias[0, 0, qi, ki]

    bm_hand = create_block_mask(hand_mod, 1, 1, Q, K, device="cuda")
    bm_ours = flex.block_mask_from_dense(mask, Q, K, 2, True, mask_mod=hand_mod)
    for a in ("kv_num_blocks", "full_kv_num_blocks", "q_num_blocks", "full_q_num_blocks"):
        print(a, "hand", int(getattr(bm_hand, a).sum()), "ours", int(getattr(bm_ours, a).sum()))
    # Same tile counts as create_block_mask (Q, K multiples of 128: no tail tiles).
    same = all(
        torch.equal(getattr(bm_ours, a).int(), getattr(bm_hand, a).int())
        for a in ("kv_num_blocks", "full_kv_num_blocks", "q_num_blocks", "full_q_num_blocks")
    )
    say(f"blockmask tile counts equal to create_block_mask's: {same}")

    say(
        f"block_mask_from_dense (kv+q side): {do_bench(lambda: flex.block_mask_from_dense(mask, Q, K, 2, True, None)):.3f} ms"
    )
    say(
        f"block tensors kv side only: {do_bench(lambda: flex._block_tensors(mask, Q, K, 2, True, need_q=False)):.3f} ms"
    )
    dense = torch.ones(1, 1, Q, K, dtype=torch.bool, device="cuda")
    for ee, rows, warps in [
        (True, 16, 4),
        (True, 32, 4),
        (True, 8, 4),
        (True, 16, 2),
        (True, 32, 8),
        (False, 32, 4),
        (False, 16, 4),
    ]:
        kw = dict(rows=rows, num_warps=warps, early_exit=ee)
        ok = all(
            torch.equal(a, b)
            for a, b in zip(
                _block_tiles.tile_flags(mask, Q, K, True, **kw),
                _block_tiles.tile_flags(mask, Q, K, True, early_exit=False),
            )
        )
        t = do_bench(lambda: _block_tiles.tile_flags(mask, Q, K, True, **kw))
        td = do_bench(lambda: _block_tiles.tile_flags(dense, Q, K, True, **kw))
        say(f"tile kernel early_exit={ee} rows={rows} warps={warps}: top-k {t:.3f} ms, all-True {td:.3f} ms, same={ok}")
    del dense
    print(table(lambda: flex.block_mask_from_dense(mask, Q, K, 2, True, None)), flush=True)

    compiled = torch.compile(flex_attention, dynamic=False)

    def hand(bm):
        return compiled(qt, kt, vt, score_mod=score_mod, block_mask=bm, scale=scale, enable_gqa=True)

    def ours(need_lse=True):
        return flex.flex_dma_attention(
            q, k, v, mask, bias, is_causal=True, softmax_scale=scale, softcap=0.0, need_lse=need_lse
        )

    def clamped_mod(b, h, qi, ki):  # flexdma's earlier mask_mod: bounds + clamped indices
        keep = (qi < Q) & (ki < K) & (ki <= qi)
        return keep & mask[0, 0, torch.clamp(qi, max=Q - 1), torch.clamp(ki, max=K - 1)]

    bm_clamped = flex.block_mask_from_dense(mask, Q, K, 2, True, mask_mod=clamped_mod)

    with torch.no_grad():
        o_h = hand(bm_hand)
        o_o = ours()[0]
        say(f"out maxdiff ours vs hand: {(o_o.float() - o_h.transpose(1, 2).float()).abs().max().item():.4g}")
        for name, fn in [
            ("fwd hand+hand_bm", lambda: hand(bm_hand)),
            ("fwd hand+ours_bm", lambda: hand(bm_ours)),
            ("fwd ours", ours),
            ("fwd hand+ours_bm, clamped mask_mod", lambda: hand(bm_clamped)),
        ]:
            fn()
            say(f"{name}: {do_bench(fn):.3f} ms")
        default = _block_tiles.EARLY_EXIT
        _block_tiles.EARLY_EXIT = not default
        say(f"fwd ours, tile kernel early_exit={not default}: {do_bench(ours):.3f} ms")
        _block_tiles.EARLY_EXIT = default
        print(table(ours), flush=True)

    # Backward: ours (flexdma, dq dk dv dbias) vs hand-written with the same kernel_options.
    opts = flex.kernel_options(q.device, q.shape[-1], q.dtype, True)
    qg, kg, vg, bg = (t.detach().clone().requires_grad_(True) for t in (q, k, v, bias))
    out, _ = flex.flex_dma_attention(qg, kg, vg, mask, bg, is_causal=True, softmax_scale=scale, softcap=0.0)
    dout = torch.randn_like(out)
    torch.autograd.grad(out, (qg, kg, vg, bg), dout, retain_graph=True)
    say(f"bwd ours: {do_bench(lambda: torch.autograd.grad(out, (qg, kg, vg, bg), dout, retain_graph=True)):.3f} ms")

    def fwd_ours_train():
        return flex.flex_dma_attention(qg, kg, vg, mask, bg, is_causal=True, softmax_scale=scale, softcap=0.0)

    say(f"fwd ours (training, q side built): {do_bench(fwd_ours_train):.3f} ms")

    def score_mod_b(s, bb, h, qi, ki):
        return s + bh[0, 0, qi, ki]

    qb, kb, vb, bh = (t.detach().clone().requires_grad_(True) for t in (qt, kt, vt, bias))
    ob = compiled(
        qb, kb, vb, score_mod=score_mod_b, block_mask=bm_hand, scale=scale, enable_gqa=True, kernel_options=opts
    )
    dob = dout.transpose(1, 2)
    torch.autograd.grad(ob, (qb, kb, vb, bh), dob, retain_graph=True)
    say(f"bwd hand: {do_bench(lambda: torch.autograd.grad(ob, (qb, kb, vb, bh), dob, retain_graph=True)):.3f} ms")


if __name__ == "__main__":
    main()
