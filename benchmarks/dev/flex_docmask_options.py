"""Compiled FlexAttention's forward over the varlen bench's 64K document mixes (a document + causal
mask_mod, no bias) at FlexAttention's defaults and at ONE_STAGE: what flex.doc_mask_kernel_options
takes for an inference call. do_bench medians in ms.

python -m benchmarks.dev.flex_docmask_options
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import create_block_mask
from triton.testing import do_bench

from benchmarks.dev.kernel_times import MIXES
from benchmarks.peers import compiled_flex
from flexdma import flex

if __name__ == "__main__":
    for D, lengths in MIXES:
        T, H, KVH = sum(lengths), 16, 4
        q = torch.randn(1, H, T, D, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(1, KVH, T, D, device="cuda", dtype=torch.bfloat16) for _ in "kv")
        sizes = torch.tensor(lengths, device="cuda")
        doc = torch.repeat_interleave(torch.arange(len(lengths), device="cuda", dtype=torch.int32), sizes)

        def mask_mod(b, h, qi, ki):
            return (doc[qi] == doc[ki]) & (ki <= qi)

        bm = create_block_mask(mask_mod, None, None, T, T, device="cuda", BLOCK_SIZE=128, _compile=True)
        attend = compiled_flex()
        for name, opts in (("defaults", None), ("one_stage", flex.ONE_STAGE)):

            def fwd():
                return attend(q, k, v, block_mask=bm, enable_gqa=True, kernel_options=opts)

            print(f"D={D} fwd {name}: {do_bench(fwd, warmup=25, rep=100):.3f} ms", flush=True)
