"""The dense path (attn_mask / attn_bias), one home per part: `attention` (its implementations,
one per layout and backend of flexdma/_dispatch.py's table), `ops` (the fwd / bwd / tile_meta ops'
fake kernels and autograd), `flex` (FlexAttention), `naive` (the eager reference, the ground truth
of every path)."""
