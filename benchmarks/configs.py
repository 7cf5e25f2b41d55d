"""The benchmark configurations: which shapes each subcommand measures.

Fixed for every case: B=1, H=2 query heads, KVH=1 key/value head, bf16, causal (bottom-right).
A case varies the lengths, the window W (keys kept per query row), the head dim D and the bias
kind: "per-row" is a (1,1,Q,K) bias, "per-key" a (1,1,1,K) one (one importance score per key).
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

B, H, KVH = 1, 2, 1
BIAS_KINDS = ("per-row", "per-key")
HEAD_DIMS = (64, 128)  # the tables' head dims; --d may name any head dim the kernels implement
ANY_HEAD_DIMS = (32, 64, 96, 128, 192, 256)

# Peer ids, in table order. "flexattn" is FlexAttention written by hand; "flexdma-*" are this
# library's backends; "dense" is causal SDPA with no mask and no bias (the ceiling).
PEERS = ("flexdma-auto", "flexdma-cuda", "flexdma-flex", "sdpa", "flexattn", "flash_dmattn", "dense")
FLEXDMA_PEERS = ("flexdma-auto", "flexdma-cuda", "flexdma-flex")

TRAIN_LENGTHS = tuple(2**i for i in range(8, 16))  # 256 .. 32768
WINDOW_LENGTH = 32768
WINDOWS = tuple(2**i for i in range(5, 16))  # 32 .. 32768
DECODE_LENGTHS = tuple(2**i for i in range(8, 20))  # 256 .. 524288
TRAIN_WINDOW = DECODE_WINDOW = 1024

# Peers that are known to take far longer than the rest at some size, and so would push one
# invocation past its time limit: (peer, direction) -> largest query length still run. They are
# recorded as skipped with this reason; --no-limits lifts them.
LIMITS: Dict[Tuple[str, str], int] = {
    ("sdpa", "bwd"): 16384,  # ~75 ms a call at 32K on an H100 (math/efficient kernel with a bias grad)
}


@dataclasses.dataclass(frozen=True)
class Case:
    mode: str  # "train" or "decode"
    Q: int
    K: int
    W: int
    D: int
    bias: str  # "per-row" or "per-key"
    dirs: Tuple[str, ...] = ("fwd",)

    @property
    def bias_shape(self) -> Tuple[int, int, int, int]:
        return (1, 1, self.Q, self.K) if self.bias == "per-row" else (1, 1, 1, self.K)

    @property
    def key(self) -> str:
        return f"{self.mode}-{self.bias}-D{self.D}-Q{self.Q}-K{self.K}-W{self.W}"

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.update(B=B, H=H, KVH=KVH, dirs=list(self.dirs))
        return d


def limit_reason(peer: str, direction: str, case: Case) -> Optional[str]:
    top = LIMITS.get((peer, direction))
    if top is not None and case.Q > top:
        return f"skipped: {peer} {direction} above Q={top} (slow; --no-limits runs it)"
    return None


def parse_list(text: Optional[str], allowed: Sequence, cast=str) -> Optional[List]:
    """'a,b' -> [a, b], checked against `allowed`; None passes through."""
    if text is None:
        return None
    items = [cast(t.strip()) for t in str(text).split(",") if t.strip()]
    bad = [t for t in items if t not in allowed]
    if bad or not items:
        raise ValueError(f"expected a comma-separated subset of {list(allowed)}, got {text!r}")
    return items


def _product(mode, lengths, windows, ds, biases, dirs, decode=False) -> List[Case]:
    out = []
    for d in ds:
        for b in biases:
            for L in lengths:
                for w in windows:
                    out.append(Case(mode, 1 if decode else L, L, w, d, b, tuple(dirs)))
    return out


def training_cases(
    dirs: Iterable[str], *, quick=False, ds=HEAD_DIMS, biases=BIAS_KINDS, lengths: Optional[Sequence[int]] = None
) -> List[Case]:
    lengths = lengths or ((1024, 4096, 16384) if quick else TRAIN_LENGTHS)
    if quick:
        ds, biases = ds[-1:], biases[:1]
    return _product("train", lengths, (TRAIN_WINDOW,), ds, biases, dirs)


def window_cases(
    dirs: Iterable[str],
    *,
    quick=False,
    ds=HEAD_DIMS,
    biases=BIAS_KINDS,
    windows: Optional[Sequence[int]] = None,
    length: int = WINDOW_LENGTH,
) -> List[Case]:
    if quick:
        windows, length, ds, biases = windows or (64, 1024, 8192), 8192, ds[-1:], biases[:1]
    return _product("train", (length,), windows or WINDOWS, ds, biases, dirs)


def decode_cases(
    *, quick=False, ds=HEAD_DIMS, biases=BIAS_KINDS, lengths: Optional[Sequence[int]] = None
) -> List[Case]:
    # With one query a per-row bias (1,1,1,K) and a per-key one are the same tensor: run one kind.
    lengths = lengths or ((8192, 65536, 524288) if quick else DECODE_LENGTHS)
    if quick:
        ds = ds[-1:]
    return _product("decode", lengths, (DECODE_WINDOW,), ds, list(biases)[:1], ("fwd",), decode=True)


def equivalence_cases(*, quick=False, ds=HEAD_DIMS, biases=BIAS_KINDS) -> List[Case]:
    """Small shapes, odd lengths included (partial tiles), for the agreement check."""
    shapes = [(128, 128, 32), (257, 257, 64), (1, 1000, 64), (200, 333, 48)]
    if quick:
        shapes = shapes[:2]
    out = []
    for d in ds:
        for b in biases:
            for q, k, w in shapes:
                out.append(Case("train" if q > 1 else "decode", q, k, w, d, b, ("fwd", "bwd")))
    return out
