"""Runs the per-key step of T new tokens (flexdma/perkey/triton_rows.py) in Triton's interpreter on
the CPU against flexdma.perkey.decode.append_rows (the Python updates), bit for bit: the union's
key indices and scores, each row's keep row, and the kept set after the last key (updated in
place). tests/perkey/test_perkey.py runs it in a process of its own and its CUDA test imports the checks
from here. Exits 0 when every case matches."""

import os
import sys

if __name__ == "__main__":
    os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import interpret_patch  # noqa: F401  (the interpreter's NumPy patch)

import torch  # noqa: E402

from flexdma.perkey import decode  # noqa: E402

NAN, INF = float("nan"), float("inf")


def case(B, P, W, n, T, dtype, *, s_dtype=None, special=False, seed=0, device="cpu"):
    """A kept set of the last of n keys with its slots shuffled, and T new keys' scores and
    eligibility (special: ties, NaN / -inf / signed zeros, ties with kept scores)."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(B, P, n, generator=g)
    s_new = torch.randn(B, P, T, generator=g)
    if special:
        scores, s_new = (scores * 2).round() / 2, (s_new * 2).round() / 2  # ties, with each other too
        for t in (scores, s_new):
            flat = t.view(-1)
            if not flat.numel():
                continue
            pick = torch.randint(0, flat.numel(), (max(1, flat.numel() // 6),), generator=g)
            flat[pick] = torch.tensor([-INF, -0.0, 0.0, NAN, INF])[torch.arange(pick.numel()) % 5]
    kept = decode.last_row(scores.to(dtype), W)
    perm = torch.rand(B, P, W, generator=g).argsort(-1)
    kept = decode.KeptSet(*(t.gather(-1, perm).to(device) for t in kept))
    eligible = (torch.rand(B, P, T, generator=g) > 0.2).to(device)
    return kept, s_new.to(s_dtype or dtype).to(device), eligible


def check(B, P, W, n, T, dtype, **kw):
    from flexdma.perkey.triton_rows import append_rows

    kept, s_new, eligible = case(B, P, W, n, T, dtype, **kw)
    label = f"B={B} P={P} W={W} n={n} T={T} {dtype} {kw}"
    mine = decode.KeptSet(*(t.clone() for t in kept))
    want = decode.append_rows(kept, s_new, n, eligible)
    got = append_rows(mine, s_new, n, eligible)
    assert got.kept is mine, label
    for name in ("idx", "keep"):
        assert torch.equal(getattr(got, name), getattr(want, name)), f"{name} differs: {label}"
    _same_scores(got.score, want.score, label)
    assert torch.equal(mine.idx, want.kept.idx) and torch.equal(mine.valid, want.kept.valid), f"kept: {label}"
    _same_scores(mine.score, want.kept.score, label)
    print("ok", label, flush=True)


def _same_scores(a, b, label):
    assert a.dtype == b.dtype and torch.equal(a.isnan(), b.isnan()), f"score NaNs differ: {label}"
    bits = {2: torch.int16, 4: torch.int32}[a.element_size()]
    assert torch.equal(a.view(bits)[~a.isnan()], b.view(bits)[~b.isnan()]), f"score bits differ: {label}"


if __name__ == "__main__":
    check(1, 1, 1, 1, 2, torch.bfloat16)  # one slot
    check(2, 3, 5, 3, 4, torch.float16, special=True)  # free slots fill, then replacements
    check(3, 2, 64, 100, 17, torch.bfloat16, special=True, seed=1)  # W past a block of 16
    check(1, 2, 300, 200, 64, torch.float32, seed=2)  # free slots left after T keys
    check(2, 1, 40, 90, 9, torch.bfloat16, s_dtype=torch.float32, special=True, seed=3)  # s_new rounded
    check(1, 1, 8, 0, 5, torch.float16, special=True, seed=4)  # an empty cache
    check(0, 2, 8, 10, 3, torch.bfloat16, seed=7)  # no batch rows
    from flexdma.perkey import triton_rows

    triton_rows.MAX_BLOCK = 16  # the loops over several blocks of slots, entries and new keys
    check(2, 2, 70, 150, 40, torch.bfloat16, special=True, seed=5)
    check(1, 3, 33, 20, 20, torch.float16, seed=6)  # free slots across blocks
    sys.exit(0)
