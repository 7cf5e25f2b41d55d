"""Runs flexdma's CUDA selection kernel (flexdma/perkey/triton_select.py) in Triton's interpreter on
the CPU and checks it against the CPU op (flexdma::topk_select's C++ kernel, the same contract),
entry for entry. tests/test_topk.py runs it in a process of its own: the interpreter is chosen by
TRITON_INTERPRET=1 before triton is imported. Exits 0 when every case matches."""

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import triton.runtime.interpreter as interpreter  # noqa: E402

# Triton's interpreter (3.6) turns a scalar into int with int(array) on a one-element array, which
# NumPy 2.4 refuses ("only 0-dimensional arrays"): loops with runtime bounds need the element itself.
_patch = getattr(interpreter, "_patch_lang_tensor", None)


def _patch_lang_tensor(tensor, scope):
    _patch(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))


if _patch is not None:
    interpreter._patch_lang_tensor = _patch_lang_tensor

import flexdma  # noqa: E402, F401  (loads the ops)
from flexdma.perkey import contract, triton_select  # noqa: E402


def check(scores, W, Q, causal, tile_rows):
    P1, P2, K = scores.shape
    want = torch.ops.flexdma.topk_select(scores.float(), W, Q, causal, tile_rows)
    got = triton_select.select(scores, W, Q, causal, tile_rows)
    case = f"{tuple(scores.shape)} {scores.dtype} W={W} Q={Q} causal={causal} tile_rows={tile_rows}"
    assert torch.equal(want[0], got[0]), f"key_rank differs: {case}"
    assert torch.equal(want[1], got[1]), f"row_thr differs: {case}"
    cap = contract.list_cap(K, W, tile_rows)
    n_tiles = -(-Q // tile_rows)
    a, b = (x.view(P1 * P2, n_tiles, 1 + cap) for x in (want[2], got[2]))
    assert torch.equal(a[..., 0], b[..., 0]), f"list lengths differ: {case}"
    for p in range(P1 * P2):
        for t in range(n_tiles):
            n = int(a[p, t, 0])
            assert torch.equal(a[p, t, 1 : 1 + n], b[p, t, 1 : 1 + n]), f"plane {p} tile {t}'s list differs: {case}"
    print("ok", case, flush=True)


def main():
    g = torch.Generator().manual_seed(0)

    def scores(*shape, ties=False):
        s = torch.randn(*shape, generator=g)
        return (s * 3).round() if ties else s

    s = scores(1, 1, 300)
    s[..., 1], s[..., 3], s[..., 5], s[..., 6], s[..., 7] = float("nan"), float("-inf"), -0.0, 0.0, float("inf")
    check(s, 40, 300, True, 16)  # NaN first, -inf never kept, -0.0 ties +0.0
    check(scores(1, 2, 1500, ties=True), 100, 1200, True, 64)  # ties: the lower index first
    check(scores(2, 1, 2100), 300, 2100, True, 128)  # three prefix levels of 1024-key chunks
    check(scores(1, 1, 2100), 300, 2100, False, 128)
    check(torch.randn(1, 3, 700, generator=g).to(torch.bfloat16)[:, 1:2], 50, 700, True, 64)  # bf16, strided
    check(scores(1, 1, 1), 4, 1, True, 128)
    check(scores(1, 1, 0), 4, 5, True, 128)  # no keys
    check(scores(1, 1, 7), 4, 0, True, 128)  # no rows: ranks only
    m = scores(1, 2, 900)
    m[0, 0, torch.rand(900, generator=g) < 0.4] = float("-inf")
    m[0, 1] = float("-inf")  # a plane with no eligible key
    check(m, 60, 900, True, 64)
    # Small chunks: many chunks per level and per plane, every level boundary inside the keys.
    triton_select.chunk_size = lambda K: 256
    check(scores(1, 1, 3000), 100, 3000, True, 128)
    check(scores(1, 1, 3000), 100, 1000, True, 64)  # Q < K: bottom-right causal
    check(scores(1, 1, 1000), 100, 1500, True, 64)  # Q > K: the first rows see nothing
    check(scores(1, 1, 700), 1, 700, True, 128)
    check(scores(1, 1, 700), 5000, 700, True, 128)  # W > K
    # The chunks of the longest sequences (chunk_size past 128K keys), at a size the interpreter
    # runs in seconds: three chunks, the last one part padding.
    triton_select.chunk_size = lambda K: 4096
    check(scores(1, 1, 9000), 500, 300, True, 128)
    return 0


if __name__ == "__main__":
    sys.exit(main())
