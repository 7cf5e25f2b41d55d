"""Compiled FlexAttention's forward over the varlen bench's 64K document mixes (its FlexAttention
peer: a document + causal mask, no bias) at FlexAttention's defaults and at ONE_STAGE: what
flex.sparse_mask_kernel_options takes for an inference call. do_bench medians in ms.

python -m scripts.dev.flex_docmask_options
"""

from __future__ import annotations

from triton.testing import do_bench

from benchmarks import varlen
from flexdma.dense import flex

if __name__ == "__main__":
    for c in varlen.cases():
        base = varlen._inputs(c)
        for name, opts in (("defaults", None), ("one_stage", flex.ONE_STAGE)):
            fwd, _ = varlen._flex_docmask(c, base, False, opts)
            print(f"D={c['D']} fwd {name}: {do_bench(fwd, warmup=25, rep=100):.3f} ms", flush=True)
