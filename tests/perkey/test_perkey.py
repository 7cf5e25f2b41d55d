"""The per-key top-W path (flash_dma_attention(keep_window_size=W)) against create_mask + the
float64 reference, on every backend that runs here; the selection op; the memory bound."""

import math
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from utils import assert_graph_replays

import flexdma
from flexdma import perkey
from flexdma.dense.naive import attention_ref

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _backends(device):
    # FlexAttention compiles once per shape: on CUDA it runs on the cases marked below only.
    return ["cpu", "reference"] if device == "cpu" else ["cuda"]


# (B, Q, K, H, KVH, W, causal, bias heads, padding, empty rows)
CASES = [
    (1, 37, 37, 2, 1, 8, True, "1", False, False),
    (2, 50, 70, 4, 2, 12, True, "KVH", True, False),
    (2, 70, 50, 4, 2, 12, True, "H", False, False),  # Q > K: the first rows see nothing
    (1, 1, 90, 4, 4, 16, True, "KVH", True, False),  # decode
    (2, 33, 100, 4, 1, 200, True, "1", True, False),  # W >= K: every visible key
    (1, 64, 64, 2, 2, 5, False, "H", True, False),
    (2, 40, 40, 8, 2, 9, True, "KVH", True, True),  # a batch with every key padded
    (1, 129, 129, 2, 1, 30, True, "1", False, False),
    # One key: a one-token prompt, a cache's first step (bias key dim 1 is the per-key shape).
    (1, 1, 1, 2, 1, 4, True, "KVH", False, False),
    (2, 3, 1, 4, 2, 1, True, "H", True, False),  # Q > K = 1: only the last row sees the key
    (2, 1, 1, 2, 2, 2, False, "1", False, False),
]


def _inputs(case, device, dtype, ties=True, D=16):
    B, Q, K, H, KVH, W, causal, bh, padded, empty = case
    q = torch.randn(B, Q, H, D, dtype=torch.float64)
    k = torch.randn(B, K, KVH, D, dtype=torch.float64)
    v = torch.randn(B, K, KVH, D, dtype=torch.float64)
    nb = {"1": 1, "KVH": KVH, "H": H}[bh]
    bias = torch.randn(B if nb > 1 else 1, nb, 1, K, dtype=torch.float64) * 2
    if ties:
        bias[..., 3::7] = bias[..., 1:2]  # ties: the lower key index wins
    pad = None
    if padded:
        pad = torch.rand(B, K) < 0.8
        if empty:
            pad[-1] = False
    to = dict(device=device, dtype=dtype)
    return (q.to(**to), k.to(**to), v.to(**to), bias.to(**to), None if pad is None else pad.to(device))


def _dense(bias, pad, W, Q, causal):
    m = None if pad is None else pad[:, None, None, :]
    return flexdma.create_mask(bias.detach(), W, attn_mask=m, is_causal=causal, query_len=Q)


def _poison_cuda_allocator():
    # The next outputs reuse these all-ones blocks (NaN in every float dtype), so an element a
    # kernel leaves unwritten shows up as non-finite.
    if torch.cuda.is_available():
        blocks = [
            torch.full((n,), -1, dtype=torch.int32, device="cuda") for n in (1 << 20, 1 << 18, 1 << 16, 1 << 14) * 4
        ]
        del blocks


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c)))
def test_matches_create_mask_and_reference(device, case):
    _check_case(device, case, torch.float64 if device == "cpu" else torch.bfloat16)


# A few query rows (at most cache.FEW_ROWS) after a long context: the route through the kept sets
# of decode.py and one dense-mask call (flexdma/perkey/cache.py's few_rows) instead of the
# selection over all keys.
FEW_ROWS_CASES = [
    (2, 1, 300, 4, 2, 64, True, "KVH", True, False),
    (2, 7, 300, 4, 2, 64, True, "H", True, False),  # per query head planes: K / V gathered per head
    (1, 16, 200, 4, 1, 16, True, "1", False, False),
    (2, 5, 12, 4, 2, 3, True, "KVH", True, True),  # a batch row with every key padded
    (2, 9, 40, 4, 2, 30, True, "1", True, False),  # fewer eligible keys than W: free slots fill
    (2, 6, 80, 4, 2, 10, False, "H", True, False),  # every row the same set
    (1, 6, 5, 2, 1, 4, False, "KVH", False, False),  # Q > K without causality
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", FEW_ROWS_CASES, ids=lambda c: "x".join(map(str, c)))
def test_few_rows_route_matches_the_reference(device, case, monkeypatch):
    from flexdma.perkey import cache

    taken = []
    few_rows = cache.few_rows
    monkeypatch.setattr(cache, "few_rows", lambda *a: taken.append(1) or few_rows(*a))
    dtype = torch.float64 if device == "cpu" else torch.bfloat16
    # On CUDA the smallest head dim the dense kernels take, which the gathered call runs on.
    D = 16 if device == "cpu" else 32
    _check_case(device, case, dtype, D=D, backends=["cpu"] if device == "cpu" else ["cuda"])
    assert taken, "the call did not take the few-rows route"


# One query row without autograd (a decode step through the API): one op call,
# flexdma::perkey_last_row (its kept sets selected from every key, then the decode step's attention).
LAST_ROW_CASES = [
    (2, 1, 300, 4, 2, 64, True, "KVH", True, False),
    (2, 1, 300, 4, 2, 64, True, "H", True, False),  # a kept set a query head
    (1, 1, 3000, 8, 1, 100, True, "1", False, False),  # 8 query heads on one set
    (2, 1, 12, 4, 2, 3, True, "KVH", True, True),  # a batch row with every key padded
    (2, 1, 40, 4, 2, 30, True, "1", True, False),  # fewer eligible keys than W: free slots
    (2, 1, 80, 4, 2, 10, False, "H", True, False),
    (1, 1, 40000, 4, 2, 700, True, "KVH", True, False),  # on CUDA the keys over several CTAs
]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("case", LAST_ROW_CASES, ids=lambda c: "x".join(map(str, c)))
@pytest.mark.parametrize("ties", ["few", "all equal"])
def test_one_row_call_is_one_op(device, case, ties, monkeypatch):
    # Against the float64 reference over create_mask's selection (exact in float64 on the CPU;
    # FlashAttention's rule in bf16 on CUDA), ties to the lower key index (every score equal:
    # Doge's init), -inf and NaN-free; the call took the one op, and asked for its LSE it takes the
    # kept sets instead and agrees.
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from flexdma.perkey import cache

    taken = []
    last_row = cache.last_row
    monkeypatch.setattr(cache, "last_row", lambda *a: taken.append(1) or last_row(*a))
    dtype = torch.float64 if device == "cpu" else torch.bfloat16
    q, k, v, bias, pad = _inputs(case, device, dtype, D=16 if device == "cpu" else 64)
    if ties == "all equal":
        bias = torch.full_like(bias, 0.5)
    W, causal = case[5], case[6]
    mask = None if pad is None else pad[:, None, None, :]
    with torch.no_grad():
        out = flexdma.flash_dma_attention(q, k, v, mask, bias, is_causal=causal, keep_window_size=W)
        assert taken == [1], "the call did not take the one op"
        out2, _ = flexdma.flash_dma_attention(
            q, k, v, mask, bias, is_causal=causal, keep_window_size=W, return_lse=True
        )
    assert taken == [1], "asked for its LSE, the call took the one op"
    keep = _dense(bias, pad, W, 1, causal)
    want, _ = attention_ref(q.double(), k.double(), v.double(), keep, bias.double(), is_causal=causal)
    low, _ = attention_ref(q, k, v, keep, bias, is_causal=causal)
    err = (out.double() - want).abs().max().item()
    bound = 1e-12 if dtype == torch.float64 else 2 * (low.double() - want).abs().max().item() + 1e-3
    assert err <= bound, (err, bound)
    err2 = (out2.double() - want).abs().max().item()
    assert err2 <= (1e-12 if dtype == torch.float64 else 2 * bound), (err2, bound)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_last_row_op_float32_scores(device):
    # flexdma::perkey_last_row called directly with float32 scores (four radix passes on CUDA) over
    # 20000 keys (several CTAs a plane), ties and -inf among them: the kept set decode.last_row
    # builds, and the attention over it against the float64 reference.
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    import decode_cases

    from flexdma.perkey import decode

    g = torch.Generator().manual_seed(5)
    B, H, KVH, K, W, D = 2, 4, 2, 20000, 300, 64
    dtype = torch.float64 if device == "cpu" else torch.bfloat16
    q = torch.randn(B, 1, H, D, generator=g).to(device, dtype)
    k, v = (torch.randn(B, K, KVH, D, generator=g).to(device, dtype) for _ in range(2))
    scores = (torch.randn(B, KVH, K, generator=g) * 4).round()  # many ties
    scores[:, :, 5::9] = float("-inf")
    scores = scores.to(device)
    with torch.no_grad():
        out = torch.ops.flexdma.perkey_last_row(q, k, v, scores, W, D**-0.5, 0.0)
    kept = decode.last_row(scores, W)
    truth = decode_cases.reference(q, k, v, kept, D**-0.5, 0.0, torch.float64)
    err = (out.double() - truth).abs().max().item()
    assert err <= (1e-12 if dtype == torch.float64 else 2e-2), err


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_last_row_op_long_chunks(device):
    # 64 planes of 40000 keys: on CUDA (up to ~250 SMs) each selection CTA takes a chunk above the
    # 8192 keys its warps hold in registers, so the ordered write reads its segment again. Each
    # plane keeps 10 keys above a tied score and the first 8 of its ties, which straddle a
    # register block's end (key 1024), a warp's segment's (1280) or a chunk's (10240 on 132 SMs):
    # a tie kept out of index order moves the output by ~0.03 of a value row, well over the bound.
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    import decode_cases

    from flexdma.perkey import decode

    g = torch.Generator().manual_seed(11)
    B, H, KVH, K, D = 4, 16, 16, 40000, 16
    n_above, n_ties = 10, 8
    dtype = torch.float64 if device == "cpu" else torch.bfloat16
    q = torch.randn(B, 1, H, D, generator=g).to(device, dtype)
    k, v = (torch.randn(B, K, KVH, D, generator=g).to(device, dtype) for _ in range(2))
    scores = torch.randint(-3, 3, (B, KVH, K), generator=g).float()
    scores[..., 7::11] = float("-inf")
    for plane, s in enumerate(scores.view(B * KVH, K)):
        start = (1000, 1260, 10220)[plane % 3]
        s[start : start + 5 * 16 : 5] = 5.0  # 16 ties, the first 8 kept
        s[30000:30010] = 5.0  # ties never reached
        s[15000 + torch.randperm(15000, generator=g)[:n_above]] = 6.0
    scores = scores.to(torch.bfloat16).to(device)
    W = n_above + n_ties
    with torch.no_grad():
        out = torch.ops.flexdma.perkey_last_row(q, k, v, scores, W, D**-0.5, 0.0)
    kept = decode.last_row(scores, W)
    assert kept.valid.all() and (kept.score == 5).sum(-1).eq(n_ties).all()
    decode_cases.check_out(out, q, k, v, kept, D**-0.5, 0.0, "long chunks")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_last_row_op_edges(device):
    # flexdma::perkey_last_row at the edges: one key (W above it: free slots), a plane whose keys
    # are all -inf (output 0), an empty batch, W = 1; and its argument errors, raised before
    # anything runs.
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    import decode_cases

    from flexdma.perkey import decode

    dtype = torch.float64 if device == "cpu" else torch.bfloat16
    g = torch.Generator().manual_seed(9)

    def run(B, H, KVH, K, W, scores):
        q = torch.randn(B, 1, H, 32, generator=g).to(device, dtype)
        k, v = (torch.randn(B, K, KVH, 32, generator=g).to(device, dtype) for _ in range(2))
        scores = scores.to(device)
        with torch.no_grad():
            out = torch.ops.flexdma.perkey_last_row(q, k, v, scores, W, 32**-0.5, 0.0)
        assert out.shape == q.shape and out.dtype == dtype
        if B:
            truth = decode_cases.reference(
                q, k, v, decode.last_row(scores.expand(B, KVH, K), W), 32**-0.5, 0.0, torch.float64
            )
            err = (out.double() - truth).abs().max().item()
            assert err <= (1e-12 if dtype == torch.float64 else 2e-2), err
        return out

    run(2, 4, 2, 1, 4, torch.randn(2, 2, 1, generator=g))  # one key, W > K
    dead = torch.randn(1, 2, 50, generator=g)
    dead[0, 1] = float("-inf")
    out = run(1, 4, 2, 50, 8, dead)  # the second kv head's plane keeps nothing
    assert not out[0, 0, 2:].any()
    run(0, 4, 2, 30, 8, torch.randn(1, 1, 30, generator=g))  # empty batch
    run(2, 2, 1, 64, 1, torch.randn(2, 1, 64, generator=g))  # W = 1
    q = torch.randn(1, 1, 2, 32, device=device, dtype=dtype)
    k = torch.randn(1, 10, 1, 32, device=device, dtype=dtype)
    with pytest.raises(ValueError, match="window"):
        torch.ops.flexdma.perkey_last_row(q, k, k, torch.randn(1, 1, 10, device=device), 0, 1.0, 0.0)
    with pytest.raises(ValueError, match="scores"):
        torch.ops.flexdma.perkey_last_row(q, k, k, torch.randn(1, 3, 10, device=device), 4, 1.0, 0.0)
    with pytest.raises(ValueError, match="q must be"):
        torch.ops.flexdma.perkey_last_row(q[:, 0], k, k, torch.randn(1, 1, 10, device=device), 4, 1.0, 0.0)


@pytest.mark.parametrize("case", FEW_ROWS_CASES, ids=lambda c: "x".join(map(str, c)))
def test_few_rows_dense_call_is_decided_from_the_sizes(case, monkeypatch):
    # The route decides the gathered entries' dense-mask call from the call's sizes, before any
    # data moves (cache.gathered_call: what the dispatcher's support check reads and the dense op
    # runs): the Call of the gathered operands themselves, and it runs once.
    from flexdma import _dispatch
    from flexdma.dense import attention as dense_attention

    seen = []
    dense_op = dense_attention.op
    monkeypatch.setattr(
        dense_attention, "op", lambda plan, *a, **k: seen.append((plan.call, a[:5])) or dense_op(plan, *a, **k)
    )
    q, k, v, bias, pad = _inputs(case, "cpu", torch.float32)
    ins = [t.requires_grad_() for t in (q, k, v, bias)]
    mask = None if pad is None else pad[:, None, None, :]
    W, causal = case[5], case[6]
    flexdma.flash_dma_attention(*ins[:3], mask, ins[3], is_causal=causal, keep_window_size=W, backend="cpu")
    assert len(seen) == 1, "the call did not take the few-rows route once"
    decided, operands = seen[0]
    want = _dispatch.Call.of(*operands, is_causal=False, softcap=0.0, requires_grad=True)
    assert decided == want, (decided, want)


def test_few_rows_route_empty_batch(monkeypatch):
    # A batch of 0 rows through the route: empty outputs and gradients of the inputs' shapes.
    from flexdma.perkey import cache

    taken = []
    few_rows = cache.few_rows
    monkeypatch.setattr(cache, "few_rows", lambda *a: taken.append(1) or few_rows(*a))
    q, k, v = torch.randn(0, 2, 4, 16), torch.randn(0, 300, 2, 16), torch.randn(0, 300, 2, 16)
    bias = torch.randn(1, 2, 1, 300)
    ins = [t.requires_grad_() for t in (q, k, v, bias)]
    out, lse = flexdma.flash_dma_attention(
        *ins[:3], None, ins[3], is_causal=True, keep_window_size=8, return_lse=True, backend="cpu"
    )
    assert taken and out.shape == (0, 2, 4, 16) and lse.shape == (0, 4, 2)
    grads = torch.autograd.grad(out.sum(), ins, allow_unused=True)
    assert all(g is None or (g.shape == t.shape and not g.any()) for g, t in zip(grads, ins))


def test_few_rows_route_equals_the_selection_route(monkeypatch):
    # Against the per-key op over the selection, bf16 with ties and -inf scores: the same kept keys,
    # so outputs, LSE and gradients agree to the dense-mask kernel's rounding.
    from flexdma.perkey import cache

    g = torch.Generator().manual_seed(3)
    B, Q, K, H, KVH, D, W = 2, 6, 500, 4, 2, 32, 40
    q, k, v = (torch.randn(B, n, h, D, generator=g).bfloat16() for n, h in ((Q, H), (K, KVH), (K, KVH)))
    bias = (torch.randn(B, KVH, 1, K, generator=g) * 2).round().bfloat16()  # many ties
    bias[0, 0, 0, 7::50] = float("-inf")
    pad = torch.rand(B, K, generator=g) < 0.9
    runs = []
    for few in (True, False):
        if not few:
            monkeypatch.setattr(cache, "few_rows_ok", lambda call: False)
        ins = [t.clone().requires_grad_() for t in (q, k, v, bias)]
        out, lse = flexdma.flash_dma_attention(
            *ins[:3], pad[:, None, None, :], ins[3], is_causal=True, keep_window_size=W, return_lse=True, backend="cpu"
        )
        runs.append((out, lse) + torch.autograd.grad(out, ins, torch.ones_like(out)))
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv", "dbias"), *runs):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2, msg=name)


@pytest.mark.parametrize("Q", [3, 1])
def test_few_rows_route_compiles_fullgraph(Q):
    # Traced (decoding under torch.compile): the sort, the O(W) updates and the dense-mask op; one
    # row, the one op (flexdma::perkey_last_row).
    q, k, v, bias, pad = _inputs((2, Q, 200, 4, 2, 16, True, "KVH", True, False), "cpu", torch.float32)
    mask = pad[:, None, None, :]

    def f(q, k, v, bias):
        return flexdma.flash_dma_attention(q, k, v, mask, bias, is_causal=True, keep_window_size=16)

    torch._dynamo.reset()
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v, bias)
    torch.testing.assert_close(got, f(q, k, v, bias))


# Head dims 64 / 128: on an sm_90a build the forward and the backward are the C++ kernels
# (flexdma::perkey_fwd / perkey_bwd on CUDA) over 128-row query tiles (under a softcap, which the
# C++ backward does not take, both are Triton's); fp16 and a softcap on some of them; a decode
# whose keys split; lists of several 64-entry pieces over several query tiles, causal with GQA and
# per-query-head planes without causality.
SM90_CASES = CASES + [
    (1, 1, 2000, 2, 1, 600, True, "1", True, False),
    (2, 700, 700, 4, 2, 150, True, "KVH", True, False),
    (1, 300, 500, 4, 1, 100, False, "H", False, False),
]


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("case", SM90_CASES, ids=lambda c: "x".join(map(str, c)))
def test_cuda_head_dims_match_reference(case, D):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from flexdma.perkey import route

    i = SM90_CASES.index(case)
    dtype = torch.float16 if i % 3 == 1 else torch.bfloat16
    softcap = 5.0 if i % 4 == 2 else 0.0
    why = route.kernels_reason(_case_call(case, dtype, D), False, False)
    if why is not None:
        pytest.skip(f"the C++ per-key kernels do not run here: {why}")
    _check_case("cuda", case, dtype, D=D, softcap=softcap, cpp=True)


def _call(q, k, v, bias, W, causal, softcap=0.0, requires_grad=True):
    from flexdma import _dispatch

    return _dispatch.Call.of(
        q, k, v, None, bias, is_causal=causal, softcap=softcap, keep_window_size=W, requires_grad=requires_grad
    )


def _case_call(case, dtype, D, softcap=0.0):
    """The dispatch's Call of a case on CUDA, a backward following (no inputs drawn)."""
    B, Q, K, H, KVH, W, causal, bh, *_ = case
    nb = {"1": 1, "KVH": KVH, "H": H}[bh]
    q = torch.empty(B, Q, H, D, dtype=dtype, device="cuda")
    k, v = (torch.empty(B, K, KVH, D, dtype=dtype, device="cuda") for _ in range(2))
    bias = torch.empty(B if nb > 1 else 1, nb, 1, K, dtype=dtype, device="cuda")
    return _call(q, k, v, bias, W, causal, softcap)


# Every head dim the README lists, through backend="auto": the per-key CUDA kernels where they take
# the head dim (wide ones with their smaller tiles), else the fallback with its one-time warning.
# GQA groups of 4 with a per-kv-head bias pack several query heads into one program.
HEAD_DIM_CASES = [CASES[1], CASES[3], CASES[7], (2, 300, 300, 8, 2, 40, True, "KVH", True, False)]


@pytest.mark.gpu
@pytest.mark.parametrize("D", [32, 64, 96, 128, 192, 256])
@pytest.mark.parametrize("case", HEAD_DIM_CASES, ids=lambda c: "x".join(map(str, c)))
def test_cuda_every_listed_head_dim(case, D):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    i = HEAD_DIM_CASES.index(case)
    softcap = 5.0 if i == 2 else 0.0
    torch.manual_seed(1000 * i + D)  # inputs that do not depend on which tests ran before

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _check_case("cuda", case, torch.bfloat16, D=D, softcap=softcap, backends=["auto"])
    fallbacks = [str(w.message) for w in seen if "falls back" in str(w.message)]
    if perkey.cuda_unsupported_reason(_case_call(case, torch.bfloat16, D, softcap)) is None:
        assert not fallbacks, fallbacks


def _check_case(device, case, dtype, D=16, softcap=0.0, cpp=False, backends=None):
    B, Q, K, H, KVH, W, causal, *_ = case
    q, k, v, bias, pad = _inputs(case, device, dtype, D=D)
    mask = _dense(bias, pad, W, Q, causal)
    grad = torch.randn(B, Q, H, D, dtype=torch.float64, device=device)
    ref = {}
    for prec in (torch.float64, dtype):
        ins = [t.detach().to(prec).requires_grad_() for t in (q, k, v, bias)]
        o, lse = attention_ref(ins[0], ins[1], ins[2], mask, ins[3], is_causal=causal, softcap=softcap)
        gs = torch.autograd.grad(o, ins, grad.to(prec))
        ref[prec] = (o, lse) + gs
    if backends is None:
        backends = _backends(device) + (["flex"] if device == "cuda" and case in CASES[:2] and not cpp else [])
    for backend in backends:
        ins = [t.detach().clone().requires_grad_() for t in (q, k, v, bias)]
        if cpp:
            from flexdma.perkey import route

            r = route.decide(backend, _call(*ins, W, causal, softcap))
            want = "cuda" if softcap == 0 else "triton"  # the C++ backward takes no softcap
            assert (r.forward, r.backward) == (want, want), r
        _poison_cuda_allocator()
        out, lse = flexdma.flash_dma_attention(
            ins[0],
            ins[1],
            ins[2],
            pad,
            ins[3],
            is_causal=causal,
            keep_window_size=W,
            return_lse=True,
            backend=backend,
            softcap=softcap,
        )
        got = (out, lse) + torch.autograd.grad(out, ins, grad.to(dtype))
        for name, g, r, lo in zip(("out", "lse", "dq", "dk", "dv", "dbias"), got, ref[torch.float64], ref[dtype]):
            assert g.shape == r.shape, (backend, name)
            fin = torch.isfinite(r)
            assert torch.equal(torch.isfinite(g), fin), (backend, name, "non-finite pattern")
            err = (g.double() - r)[fin].abs().max().item() if fin.any() else 0.0
            if dtype == torch.float64:
                assert err < 1e-9, (backend, name, err)
            else:
                floor = 1e-2 if name == "dbias" else 1e-3
                lo_err = (lo.double() - r)[fin].abs().max().item() if fin.any() else 0.0
                assert err <= 2 * lo_err + floor, (backend, name, err, lo_err)
        empty = torch.isneginf(ref[torch.float64][1])
        assert (out.detach().transpose(1, 2)[empty] == 0).all()


@pytest.mark.parametrize("device", DEVICES)
def test_selection_is_the_dense_mask(device):
    for case in CASES:
        B, Q, K, H, KVH, W, causal, *_ = case
        _, _, _, bias, pad = _inputs(case, device, torch.float32)
        m = None if pad is None else pad[:, None, None, :]
        scores = perkey.selection_scores(bias, m, H)
        rows = 64 if device == "cpu" else 32
        sel = perkey.select(scores, W, Q, causal, rows)
        dense = perkey.keep_mask(sel, Q, K, causal)
        want = _dense(bias, pad, W, Q, causal)
        shape = torch.broadcast_shapes(dense.shape, want.shape)
        assert torch.equal(dense.expand(shape), want.expand(shape)), case
        # Each tile's list holds every key some row of the tile keeps (and keys the last row sees
        # within the tile's largest threshold), in rank order.
        lists = perkey.tile_lists(sel, Q, rows)
        n = lists[..., 0]
        for t in range(n.shape[-1]):
            union = dense[:, :, t * rows : (t + 1) * rows].any(2)
            for p1 in range(union.shape[0]):
                for p2 in range(union.shape[1]):
                    listed = lists[p1, p2, t, 1 : 1 + n[p1, p2, t]].long()
                    assert set(union[p1, p2].nonzero().flatten().tolist()) <= set(listed.tolist())
                    assert torch.all(sel.key_rank[p1, p2, listed].diff() > 0)
        assert n.max() <= min(K, W + rows - 1)


def test_cpu_and_cuda_selection_agree():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    scores = torch.randn(2, 3, 3000)
    scores[..., ::11] = scores[..., 5:6]
    scores[0, 1, ::3] = float("-inf")
    for causal in (True, False):
        for Q in (1, 1000, 3000):
            a = perkey.select(scores, 300, Q, causal, 32)
            b = perkey.select(scores.cuda(), 300, Q, causal, 32)
            assert torch.equal(a.key_rank, b.key_rank.cpu()) and torch.equal(a.row_thr, b.row_thr.cpu())
            la, lb = perkey.tile_lists(a, Q, 32), perkey.tile_lists(b, Q, 32).cpu()
            n = la[..., 0]
            assert torch.equal(n, lb[..., 0])
            for idx in n.flatten().nonzero().flatten().tolist()[:50]:
                p1, p2, t = torch.unravel_index(torch.tensor(idx), n.shape)
                m = int(n[p1, p2, t])
                assert torch.equal(la[p1, p2, t, : 1 + m], lb[p1, p2, t, : 1 + m])


def _assert_cuda_selection_is_the_cpu_op(scores, W, Q, causal, rows=128):
    # Ranks, thresholds and every list entry up to its length (the entries past it are unspecified).
    a = perkey.select(scores, W, Q, causal, rows)
    b = perkey.select(scores.cuda(), W, Q, causal, rows)
    assert torch.equal(a.key_rank, b.key_rank.cpu()) and torch.equal(a.row_thr, b.row_thr.cpu())
    la, lb = perkey.tile_lists(a, Q, rows), perkey.tile_lists(b, Q, rows).cpu()
    assert la.shape == lb.shape
    if la.numel() == 0:  # no rows or no planes: no lists
        return
    assert torch.equal(la[..., 0], lb[..., 0])
    keep = torch.arange(la.shape[-1]) <= la[..., :1]
    assert torch.equal(la * keep, lb * keep)


def test_cuda_selection_at_empty_and_one_key_sizes():
    # No keys, no rows, no planes, one key: the CUDA selection against the CPU op (no work items:
    # the kernel is not launched; keys without rows: only sorts and ranks; rows without keys: walks
    # that list nothing).
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    for P2, K, Q in ((2, 0, 0), (2, 0, 5), (2, 5, 0), (0, 7, 7), (2, 1, 1), (2, 1, 3), (1, 3, 1)):
        scores = torch.randn(1, P2, K)
        for causal in (True, False):
            _assert_cuda_selection_is_the_cpu_op(scores, 4, Q, causal)


def test_cuda_selection_at_every_chunk_count():
    # One to 35 of the CUDA selection's 4096-key chunks (csrc/cuda/perkey_select.cu), bf16 scores
    # read through a strided view, against the CPU op.
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    for K in (20000, 70000, 140000):
        bias = torch.randn(1, 3, 1, K).to(torch.bfloat16)[:, 1:]
        bias[0, 0, 0, ::5] = float("-inf")
        scores = bias[:, :, 0, :]
        for Q in (K, 300):
            _assert_cuda_selection_is_the_cpu_op(scores, 2048, Q, True)


def test_cuda_selection_repeats_at_unaligned_plane_strides():
    # Key counts that are no multiple of a cache line put two planes' ranks and prefix orders in
    # one line: a walk of one plane must not read another's from L1 before that plane's rank items
    # wrote it. Repeated calls over the same scores, with differently sized calls between them (the
    # allocator hands their memory back with other contents), against the first call and the CPU
    # op: every call equal, none faults.
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    g = torch.Generator().manual_seed(0)
    for K, W in ((1175, 2048), (3001, 1024), (777, 256)):
        scores = torch.randn(2, 4, K, generator=g).exp().to(torch.bfloat16)
        want = perkey.select(scores, W, K, True, 128)
        first = perkey.select(scores.cuda(), W, K, True, 128)
        assert torch.equal(want.key_rank, first.key_rank.cpu()) and torch.equal(want.row_thr, first.row_thr.cpu())
        lf = perkey.tile_lists(first, K, 128)
        listed = torch.arange(lf.shape[-1], device="cuda") <= lf[..., :1]  # entries past a list's end are unspecified
        other = torch.randn(1, 3, K + 517, device="cuda")
        for _ in range(60):
            perkey.select(other, W, K + 517, True, 128)
            got = perkey.select(scores.cuda(), W, K, True, 128)
            assert torch.equal(got.key_rank, first.key_rank) and torch.equal(got.row_thr, first.row_thr)
            assert torch.equal(perkey.tile_lists(got, K, 128) * listed, lf * listed)
        torch.cuda.synchronize()


def test_triton_attention_at_padded_head_dims_in_the_interpreter():
    # The per-key Triton forward and backward (atomics and deterministic) at head dims 96, 48 and
    # 192 (padded to a power of two inside the kernels) and 64, in Triton's interpreter, against the
    # float64 reference over the same selection.
    _run_triton_script("interpret_attention.py", 4)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_decode_step(device):
    # flexdma::decode_step (the kept set's in-place update and the new row's attention in one call)
    # against decode.append bit for bit and the float64 reference over the new kept set: free
    # slots, replacements, ties, NaN / -inf / signed-zero scores, softcap, a position on the device,
    # up to 32 query heads a kv head, head dims 16 to 256, one split a plane and many (CUDA).
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    import decode_cases

    decode_cases.check_all(device)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_decode_append(device, dtype):
    # flexdma::decode_append (nn.DMACache's step): the new key's rows, bias and padding written into
    # the caches at the position, and everything else as decode_step on caches that already hold
    # them; the rows past the position untouched.
    if device == "cuda" and (not torch.cuda.is_available() or dtype == torch.float64):
        pytest.skip("needs a CUDA device" if dtype != torch.float64 else "the CUDA kernels take 16-bit floats")
    import decode_cases

    from flexdma.perkey import decode

    B, H, KVH, W, D, n = 2, 6, 3, 50, 64, 80
    q, k, v, kept = decode_cases.make(B, H, KVH, W, D, n, dtype, seed=21, device=device)
    bias = torch.randn(B, KVH, k.shape[1], dtype=dtype, device=device)
    padding = torch.rand(B, k.shape[1], device=device) > 0.1
    k_new, v_new = torch.randn(2, B, 1, KVH, D, dtype=dtype, device=device)
    b_new = torch.randn(B, KVH, 1, 1, dtype=dtype, device=device)
    p_new = torch.tensor([[True], [False]], device=device)
    caches = [t.clone() for t in (k, v, bias, padding)]
    got = decode.KeptSet(*(t.clone() for t in kept))
    out = torch.ops.flexdma.decode_append(q, k_new, v_new, b_new, p_new, *caches, *got, n, 0.125, 0.0)
    want_caches = [t.clone() for t in (k, v, bias, padding)]
    want_caches[0][:, n], want_caches[1][:, n] = k_new[:, 0], v_new[:, 0]
    want_caches[2][..., n], want_caches[3][:, n] = b_new[..., 0, 0], p_new[:, 0]
    want = decode.KeptSet(*(t.clone() for t in kept))
    eligible = p_new.expand(B, KVH)
    want_out = decode.attend_one(q, want_caches[0], want_caches[1], want, b_new[..., 0, 0], n, eligible, 0.125)
    assert all(torch.equal(a, b) for a, b in zip(caches, want_caches))
    decode_cases.check_kept(got, want, "decode_append")
    torch.testing.assert_close(out, want_out, rtol=0, atol=0)
    with pytest.raises(ValueError, match="position"):
        torch.ops.flexdma.decode_append(q, k_new, v_new, b_new, p_new, *caches, *got, k.shape[1], 0.125, 0.0)
    with pytest.raises(ValueError, match="bias_new"):
        torch.ops.flexdma.decode_append(q, k_new, v_new, b_new[:, :1], p_new, *caches, *got, n, 0.125, 0.0)
    with pytest.raises(TypeError, match="padding_new"):
        torch.ops.flexdma.decode_append(q, k_new, v_new, b_new, p_new.int(), *caches, *got, n, 0.125, 0.0)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_cuda_decode_step_traced(mode):
    # Under torch.compile (transformers' compiled generation) the step is the op in the graph, also
    # replayed from a CUDA graph: steps of new keys against eager calls, the output and the kept set
    # bit for bit, the set in its own buffers.
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    import decode_cases as dc

    from flexdma.perkey import decode

    torch._dynamo.reset()
    B, H, KVH, W, D, n = 2, 8, 2, 256, 128, 1000
    q, k, v, kept = dc.make(B, H, KVH, W, D, n, torch.bfloat16, transposed=True, seed=17, device="cuda")
    k, v = k[:, : n + 1], v[:, : n + 1]  # the new key's row at position n
    traced = decode.KeptSet(*(t.clone() for t in kept))
    for t in traced:
        torch._dynamo.mark_static_address(t)
    where = [t.data_ptr() for t in traced]
    pos = torch.full((1,), n, device="cuda")

    @torch.compile(fullgraph=True, mode=mode)
    def step(q, s_new, eligible):
        return decode.attend_one(q, k, v, traced, s_new, pos, eligible, 0.1) * 1  # (an op after it)

    for i in range(4):
        s_new, eligible = dc.new_key(kept, torch.bfloat16, 40 + i)
        q = torch.randn_like(q)
        want = decode.attend_one(q, k, v, kept, s_new, pos, eligible, 0.1)
        got = step(q, s_new, eligible).clone()
        assert torch.equal(got, want), f"step {i}"
        assert all(torch.equal(a, b) for a, b in zip(traced, kept)), f"step {i}: kept sets differ"
    assert [t.data_ptr() for t in traced] == where


@pytest.mark.gpu
def test_cuda_decode_step_graph():
    # One step captured in a CUDA graph (a static cache, the position a device tensor) and replayed
    # step after step against eager calls: the kept set bit for bit, the output's NaN pattern.
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    import decode_cases as dc

    from flexdma.perkey import decode

    bf16 = torch.bfloat16
    B, H, KVH, W, D, n = 2, 8, 2, 256, 128, 300
    q, k, v, kept = dc.make(B, H, KVH, W, D, n, bf16, transposed=True, seed=13, device="cuda")
    s_new = torch.zeros(B, KVH, dtype=bf16, device="cuda")
    eligible = torch.ones(B, KVH, dtype=torch.bool, device="cuda")
    pos = torch.full((1,), n, device="cuda")

    def call(kept_set):
        return decode.attend_one(q, k, v, kept_set, s_new, pos, eligible, 0.1)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call(decode.KeptSet(*(t.clone() for t in kept)))
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call(kept)
    want = decode.KeptSet(*(t.clone() for t in kept))
    for t in range(6):
        s, e = dc.new_key(want, bf16, 20 + t, special=t % 2 == 1)
        s_new.copy_(s)
        eligible.copy_(e)
        pos.fill_(n + t)
        q.copy_(torch.randn_like(q))
        eager = decode.KeptSet(*(x.clone() for x in want))
        eager_out = decode.attend_one(q, k, v, eager, s_new, n + t, eligible, 0.1)
        want = decode.append(want, s_new, n + t, eligible)
        out.fill_(float("nan"))  # poison: the replay must write every element
        graph.replay()
        dc.check_kept(kept, want, f"graph step {t}")
        dc.check_kept(eager, want, f"eager step {t}")
        torch.testing.assert_close(out, eager_out, rtol=0, atol=0, equal_nan=True, msg=f"graph step {t}")


def test_triton_rows_step_in_the_interpreter():
    # A step of T new tokens (flexdma/perkey/triton_rows.py) in Triton's interpreter against
    # decode.append_rows' Python updates, bit for bit.
    _run_triton_script("interpret_rows.py", 9)


def test_rows_kernel_compiles_for_sm90():
    # The few-rows decode kernel compiled for an H100 ahead of time (no GPU needed): what the
    # interpreter does not check (types, layouts, shared memory).
    _run_triton_script("compile_sm90.py", 1)


def test_cuda_rows_step():
    # The same kernel on the GPU against the Python updates (run on the CPU).
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    pytest.importorskip("triton")
    import interpret_rows as ir

    from flexdma.perkey import decode
    from flexdma.perkey.triton_rows import append_rows

    for i, (B, P, W, n, T, dtype, kw) in enumerate(
        [
            (2, 3, 5, 3, 4, torch.float16, dict(special=True)),
            (3, 2, 1024, 5000, 64, torch.bfloat16, dict(special=True)),
            (1, 4, 2048, 1000, 7, torch.bfloat16, dict(s_dtype=torch.float32)),
        ]
    ):
        kept, s_new, eligible = ir.case(B, P, W, n, T, dtype, seed=i, **kw)
        mine = decode.KeptSet(*(t.cuda() for t in kept))
        want = decode.append_rows(kept, s_new, n, eligible)
        got = append_rows(mine, s_new.cuda(), n, eligible.cuda())
        assert torch.equal(got.idx.cpu(), want.idx) and torch.equal(got.keep.cpu(), want.keep)
        ir._same_scores(got.score.cpu(), want.score, i)
        assert torch.equal(mine.idx.cpu(), want.kept.idx) and torch.equal(mine.valid.cpu(), want.kept.valid)
        ir._same_scores(mine.score.cpu(), want.kept.score, i)


def _run_triton_script(script: str, cases: int) -> None:
    import importlib.util
    import os
    import subprocess
    import sys

    path = os.environ.get("FLEXDMA_TRITON_PATH")
    if importlib.util.find_spec("triton") is None and not path:
        pytest.skip("triton is not installed (dev.sh test installs it into build/ and sets FLEXDMA_TRITON_PATH)")
    env = dict(os.environ)
    here = os.path.dirname(os.path.abspath(__file__))  # the scripts sit beside this file
    root = os.path.dirname(os.path.dirname(here))  # the repository, for flexdma
    env["PYTHONPATH"] = os.pathsep.join(x for x in (root, path, env.get("PYTHONPATH")) if x)
    r = subprocess.run(
        [sys.executable, os.path.join(here, script)], env=env, capture_output=True, text=True, timeout=900
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.stdout.count("ok ") == cases, r.stdout


def test_gradcheck_fp64():
    # No ties: finite differences of the bias must not change which keys are kept.
    q, k, v, bias, pad = _inputs((2, 9, 11, 4, 2, 4, True, "KVH", True, False), "cpu", torch.float64, ties=False)
    ins = [t.requires_grad_() for t in (q, k, v, bias)]

    def f(q, k, v, b):
        return flexdma.flash_dma_attention(q, k, v, pad, b, is_causal=True, keep_window_size=4, backend="cpu")

    assert torch.autograd.gradcheck(f, ins, eps=1e-6, atol=1e-6, rtol=1e-5)


def test_flex_matches_in_inference():
    case = (1, 40, 40, 2, 1, 7, True, "1", True, False)
    q, k, v, bias, pad = _inputs(case, "cpu", torch.float32)
    with torch.no_grad():
        a = flexdma.flash_dma_attention(q, k, v, pad, bias, is_causal=True, keep_window_size=7, backend="flex")
        b = flexdma.flash_dma_attention(q, k, v, pad, bias, is_causal=True, keep_window_size=7, backend="reference")
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


class _LargestTensor(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_no_q_by_k_tensor_at_16k():
    L, W = 16384, 64
    q = torch.randn(1, L, 1, 16)
    k = torch.randn(1, L, 1, 16)
    v = torch.randn(1, L, 1, 16)
    bias = torch.randn(1, 1, 1, L)
    with torch.no_grad(), _LargestTensor() as mode:
        out = flexdma.flash_dma_attention(q, k, v, None, bias, is_causal=True, keep_window_size=W, backend="cpu")
    assert out.shape == q.shape and torch.isfinite(out).all()
    # The selection's tile lists are the largest: ceil(L / 64) x (W + 63) entries, far below L * L / 64.
    assert mode.largest < L * L // 64, mode.largest
    assert mode.largest <= (L // 64) * (W + 64) + L * 16


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(keep_window_size=0), "keep_window_size must be a positive int"),
        (dict(keep_window_size=True), "keep_window_size must be a positive int"),
        (dict(keep_window_size=4, attn_bias="none"), "needs a per-key attn_bias|pass a per-key attn_bias"),
        (dict(keep_window_size=4, attn_bias="rows"), "needs a per-key attn_bias"),
        (dict(keep_window_size=4, attn_mask="rows"), "attn_mask may only drop keys for every row"),
        (dict(keep_window_size=4, backend="flex", train=True), "FlexAttention has no CPU backward"),
    ],
)
def test_rejected_inputs(kwargs, match):
    q, k, v, bias, _ = _inputs((1, 8, 8, 2, 1, 4, True, "1", False, False), "cpu", torch.float32)
    kw = dict(kwargs)
    train = kw.pop("train", False)
    mask = None
    if kw.get("attn_bias") == "none":
        bias = None
    elif kw.get("attn_bias") == "rows":
        bias = torch.randn(1, 1, 8, 8)
    if kw.pop("attn_mask", None) == "rows":
        mask = torch.ones(1, 1, 8, 8, dtype=torch.bool)
    kw.pop("attn_bias", None)
    if train:
        q.requires_grad_()
    with pytest.raises(ValueError, match=match):
        flexdma.flash_dma_attention(q, k, v, mask, bias, is_causal=True, **kw)


def test_opcheck_perkey_select():
    scores = torch.randn(2, 3, 50)
    scores[0, 0, ::4] = float("-inf")
    for causal in (True, False):
        torch.library.opcheck(torch.ops.flexdma.perkey_select, (scores, 7, 40, causal, 16))


def test_opcheck_decode_ops():
    # The decode ops' schemas, fake kernels and mutation annotations (the kept set; decode_append's
    # caches too) against their CPU kernels.
    import decode_cases

    from flexdma.perkey import decode

    q, k, v, kept = decode_cases.make(2, 4, 2, 20, 32, 40, torch.float32, seed=3)
    s_new, eligible = decode_cases.new_key(kept, torch.float32, 4)
    torch.library.opcheck(torch.ops.flexdma.decode_step, (q, k, v, *kept, s_new, eligible, 40, None, 0.2, 0.0))
    caches = (k.clone(), v.clone(), torch.randn(2, 2, k.shape[1]), torch.ones(2, k.shape[1], dtype=torch.bool))
    new = (torch.randn(2, 1, 2, 32), torch.randn(2, 1, 2, 32), torch.randn(2, 2, 1, 1), eligible[:, :1])
    kept2 = decode.KeptSet(*(t.clone() for t in kept))
    torch.library.opcheck(torch.ops.flexdma.decode_append, (q, *new, *caches, *kept2, 40, 0.2, 0.0))
    torch.library.opcheck(torch.ops.flexdma.perkey_last_row, (q, k, v, torch.randn(2, 2, k.shape[1]), 7, 0.2, 0.0))


@pytest.mark.parametrize("Q", [24, 1])
def test_compile_fullgraph_and_export(Q):
    # Q = 1: the one-row call's op (flexdma::perkey_last_row) in the graph.
    q, k, v, bias, pad = _inputs((2, Q, 24, 4, 2, 6, True, "KVH", True, False), "cpu", torch.float32)

    class M(torch.nn.Module):
        def forward(self, q, k, v, pad, bias):
            return flexdma.flash_dma_attention(
                q, k, v, pad[:, None, None, :], bias, is_causal=True, keep_window_size=6, backend="cpu"
            )

    with torch.no_grad():
        eager = M()(q, k, v, pad, bias)
        compiled = torch.compile(M(), fullgraph=True, backend="aot_eager")(q, k, v, pad, bias)
        torch.testing.assert_close(compiled, eager)
        ep = torch.export.export(M(), (q, k, v, pad, bias))
        torch.testing.assert_close(ep.module()(q, k, v, pad, bias), eager)
    ops = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert ("flexdma.perkey_last_row.default" in ops) == (Q == 1), ops


def _graph_inputs(seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    B, L, H, KVH, D = 2, 700, 4, 2, 128
    q, k, v = (torch.randn(B, L, h, D, device="cuda", generator=g).bfloat16() for h in (H, KVH, KVH))
    bias = torch.randn(B, KVH, 1, L, device="cuda", generator=g).exp().bfloat16()
    dout = torch.randn(B, L, H, D, device="cuda", generator=g).bfloat16()
    return q, k, v, bias, dout


def _train_call(q, k, v, bias, dout):
    out = flexdma.flash_dma_attention(q, k, v, None, bias, is_causal=True, keep_window_size=96)
    return (out,) + torch.autograd.grad(out, (q, k, v, bias), dout)


@pytest.mark.gpu
def test_cuda_graph_replays_forward_and_backward():
    # The per-key path's training call (selection, forward, backward) captured in one CUDA graph
    # (no host synchronisation inside), replayed on new inputs, against eager calls on them.
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    assert_graph_replays(_train_call, _graph_inputs, n_leaves=4)


@pytest.mark.gpu
def test_cuda_compile_reduce_overhead():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")

    def step(q, k, v, bias, dout):
        out = flexdma.flash_dma_attention(q, k, v, None, bias, is_causal=True, keep_window_size=96)
        (out.float() * dout.float()).sum().backward()
        return out

    compiled = torch.compile(step, mode="reduce-overhead")
    for seed in (0, 1, 2):
        ins = [t.requires_grad_(i < 4) for i, t in enumerate(_graph_inputs(seed))]
        got = compiled(*ins).clone()
        grads = [t.grad.clone() for t in ins[:4]]
        ref_ins = [t.detach().clone().requires_grad_(i < 4) for i, t in enumerate(ins)]
        want = step(*ref_ins)
        torch.testing.assert_close(got, want, atol=0, rtol=0)
        for a, b in zip(grads, ref_ins[:4]):
            torch.testing.assert_close(a, b.grad, atol=2e-2, rtol=2e-2)


def test_dynamic_bias_matches_doge_formula():
    B, K, KVH, D = 2, 10, 2, 8
    v = torch.randn(B, K, KVH, D, dtype=torch.float64)
    dt = torch.randn(KVH, KVH * D, dtype=torch.float64) * 0.3
    A = torch.randn(KVH, dtype=torch.float64)
    got = flexdma.dynamic.dynamic_bias(v, dt, A)
    # transformers' Doge: exp(A * softplus(dt_proj(v_flat))), one score per key and kv head.
    want = torch.exp(A * torch.nn.functional.softplus(v.reshape(B, K, KVH * D) @ dt.T)).transpose(1, 2)
    torch.testing.assert_close(got[:, :, 0], want)
    assert math.isfinite(got.sum().item())


@pytest.mark.gpu
def test_cuda_deterministic_backward_is_bitwise_reproducible():
    from flexdma.perkey import triton as perkey_triton

    case = (2, 700, 700, 8, 2, 100, True, "KVH", True, False)
    q, k, v, bias, pad = _inputs(case, "cuda", torch.bfloat16, ties=False)
    grad = torch.randn_like(q)

    def grads(deterministic):
        ins = [t.detach().clone().requires_grad_() for t in (q, k, v, bias)]
        out = flexdma.flash_dma_attention(
            ins[0],
            ins[1],
            ins[2],
            pad,
            ins[3],
            is_causal=True,
            keep_window_size=100,
            backend="cuda",
            deterministic=deterministic,
        )
        return torch.autograd.grad(out, ins, grad)

    old = perkey_triton.PARTIAL_BYTES
    try:
        perkey_triton.PARTIAL_BYTES = 1 << 20  # several chunks of query tiles
        first, second = grads(True), grads(True)
    finally:
        perkey_triton.PARTIAL_BYTES = old
    fast = grads(False)
    for a, b, c, name in zip(first, second, fast, ("dq", "dk", "dv", "dbias")):
        assert torch.equal(a, b), f"{name} differs between two deterministic runs"
        torch.testing.assert_close(a.float(), c.float(), atol=2e-2, rtol=2e-2, msg=name)


def test_list_cap_matches_the_extension():
    """The list cap rule is csrc/flash_dma_constants.h's; Python's copy (for symbolic sizes) agrees."""
    from flexdma import _C
    from flexdma.perkey import contract

    for K in (1, 7, 64, 200, 5000):
        for window in (1, 3, 64, 300):
            for rows in (16, 64, 128):
                assert contract.list_cap(K, window, rows) == _C.perkey_list_cap(K, window, rows)
    assert contract.NEVER == _C.NEVER_KEPT == 2**31 - 1
    assert contract.CPU_TILE_ROWS == _C.PERKEY_CPU_TILE_ROWS
    assert math.isclose(_C.LOG2E, math.log2(math.e), rel_tol=1e-15)
