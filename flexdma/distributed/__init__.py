"""Context parallel for flexdma on torch.distributed: one sequence over the ranks of a process group.

- `shard_sequence` / `unshard_sequence`: the head-tail layout (rank r holds chunks r and 2P-1-r of
  2P equal chunks), the one PyTorch's context parallel uses for causal attention.
- `context_parallel_attention`: the per-key (keep_window_size) call over the ranks' local tokens,
  equal to `flash_dma_attention` over the whole sequence; each rank fetches at most W rows per
  selection plane and chunk from the others, whatever the length (docs/context_parallel.md).
- `context_parallel_decode`: a decode step over a KV cache sharded by rank (the ranks' top-W lists
  and one partial output per rank move, merged by their log-sum-exp).
- `exchange_stats`: what this rank sent and received.
"""

from ._group import exchange_stats
from .attention import context_parallel_attention
from .decode import context_parallel_decode
from .layout import shard_sequence, unshard_sequence

__all__ = [
    "context_parallel_attention",
    "context_parallel_decode",
    "exchange_stats",
    "shard_sequence",
    "unshard_sequence",
]
