"""Where flexdma's FlexAttention forward spends its time at the seed's shape (32K, per-row bias,
top-1024 mask), against a hand-written compiled flex_attention: profiler tables of the BlockMask
build and of both forwards, and the cross terms (hand-written call with our BlockMask, and the
reverse) that say whether the BlockMask or the compiled call differs."""
import sys

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
from torch.profiler import ProfilerActivity, profile
from triton.testing import do_bench

sys.path.insert(0, "benchmarks")
from flex_check import build_inputs  # noqa: E402

from flexdma import flex  # noqa: E402


def table(fn, n=3):
    fn(); torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=70)


def main():
    Q = K = 32768
    q, k, v, bias, mask = build_inputs(Q, K, 1024)
    scale = 128 ** -0.5
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))

    def hand_mod(b, h, qi, ki):
        return mask[0, 0, qi, ki] & (ki <= qi)

    def score_mod(s, bb, h, qi, ki):
        return s + bias[0, 0, qi, ki]

    compiled = torch.compile(flex_attention, dynamic=False)
    bm_hand = create_block_mask(hand_mod, 1, 1, Q, K, device="cuda")
    bm_ours = flex.block_mask_from_dense(mask, Q, K, 2, True, mask_mod=hand_mod)
    print("hand kv_num sum", int(bm_hand.kv_num_blocks.sum()), "full", int(bm_hand.full_kv_num_blocks.sum()))
    print("ours kv_num sum", int(bm_ours.kv_num_blocks.sum()), "full", int(bm_ours.full_kv_num_blocks.sum()))
    print("shapes", bm_hand.kv_indices.shape, bm_ours.kv_indices.shape, bm_ours.kv_indices.dtype)

    def hand(bm):
        return compiled(qt, kt, vt, score_mod=score_mod, block_mask=bm, scale=scale, enable_gqa=True)

    with torch.no_grad():
        for name, fn in [("hand+hand_bm", lambda: hand(bm_hand)), ("hand+ours_bm", lambda: hand(bm_ours)),
                         ("ours_fwd", lambda: flex.flex_dma_attention(q, k, v, mask, bias, is_causal=True,
                                                                      softmax_scale=scale, softcap=0.0)),
                         ("ours_fwd_nolse", lambda: flex.flex_dma_attention(q, k, v, mask, bias, is_causal=True,
                                                                            softmax_scale=scale, softcap=0.0,
                                                                            need_lse=False)),
                         ("block_mask_from_dense", lambda: flex.block_mask_from_dense(mask, Q, K, 2, True, None)),
                         ("tile_any_all", lambda: flex._tile_any_all(mask, Q, K))]:
            fn()
            print(f"== {name}: {do_bench(fn):.3f} ms", flush=True)
            print(table(fn), flush=True)


if __name__ == "__main__":
    main()
