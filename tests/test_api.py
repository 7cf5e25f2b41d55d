"""Public API: argument errors, backend selection, compile/export integration, compat names."""

import functools
import re
import warnings

import expecttest
import pytest
import torch

import flexdma
from flexdma import _dispatch, _warnings
from flexdma.compat import create_mask as seed_create_mask
from flexdma.compat import flash_dmattn_func, flash_dmattn_func_auto, get_available_backends


def qkv(B=2, Q=9, K=11, H=4, KVH=2, D=16, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(0)
    return (
        torch.randn(B, Q, H, D, generator=g, dtype=dtype).to(device),
        torch.randn(B, K, KVH, D, generator=g, dtype=dtype).to(device),
        torch.randn(B, K, KVH, D, generator=g, dtype=dtype).to(device),
    )


# ---------------------------------------------------------------- bad input
def _bad_cases():
    q, k, v = qkv()
    B, Q, H, D = q.shape
    K = k.shape[1]
    yield "not a tensor", dict(query=q.tolist()), TypeError, "query must be a torch.Tensor, got list"
    yield (
        "3-D query",
        dict(query=q[0]),
        ValueError,
        r"query must be 4-D \(batch, seqlen, heads, head_dim\), got shape \(9, 4, 16\)",
    )
    yield (
        "int dtype",
        dict(query=q.long(), key=k.long(), value=v.long()),
        TypeError,
        "query must be float16, bfloat16, float32 or float64, got torch.int64",
    )
    yield "mixed dtype", dict(key=k.double()), TypeError, "query, key and value must share a dtype"
    yield (
        "k/v shapes",
        dict(value=v[:, :5]),
        ValueError,
        r"key and value must have the same shape, got \(2, 11, 2, 16\) and \(2, 5, 2, 16\)",
    )
    yield "batch", dict(key=k[:1], value=v[:1]), ValueError, "key batch 1 does not match query batch 2"
    yield (
        "head_dim",
        dict(key=k[..., :8], value=v[..., :8]),
        ValueError,
        "key head_dim 8 does not match query head_dim 16",
    )
    yield (
        "heads divide",
        dict(key=torch.randn(2, K, 3, D), value=torch.randn(2, K, 3, D)),
        ValueError,
        r"query heads \(4\) must be a multiple of key/value heads \(3\)",
    )
    yield (
        "float mask",
        dict(attn_mask=torch.ones(1, 1, Q, K)),
        TypeError,
        "attn_mask must be a bool tensor .* got torch.float32",
    )
    yield (
        "mask batch",
        dict(attn_mask=torch.ones(3, 1, Q, K, dtype=torch.bool)),
        ValueError,
        r"attn_mask of shape \(3, 1, 9, 11\) does not broadcast .* its batch dim is 3, needs 1 or 2",
    )
    yield (
        "mask heads",
        dict(attn_mask=torch.ones(1, 3, Q, K, dtype=torch.bool)),
        ValueError,
        "its heads dim is 3, needs 1 or 2 or 4",
    )
    yield (
        "mask keys",
        dict(attn_mask=torch.ones(1, 1, Q, K + 1, dtype=torch.bool)),
        ValueError,
        "its key dim is 12, needs 1 or 11",
    )
    yield (
        "mask 5-D",
        dict(attn_mask=torch.ones(1, 1, 1, Q, K, dtype=torch.bool)),
        ValueError,
        "attn_mask must have at most 4 dims",
    )
    yield (
        "bias dtype",
        dict(attn_bias=torch.randn(1, 1, Q, K, dtype=torch.float64)),
        TypeError,
        "attn_bias dtype torch.float64 must match query dtype torch.float32",
    )
    yield "bias query dim", dict(attn_bias=torch.randn(1, 1, Q - 1, K)), ValueError, "its query dim is 8, needs 1 or 9"
    yield (
        "scale",
        dict(softmax_scale=-1.0),
        ValueError,
        "softmax_scale must be a positive finite float or None, got -1.0",
    )
    yield "softcap", dict(softcap=-2.0), ValueError, r"softcap must be a finite float >= 0 \(0 disables it\), got -2.0"
    yield "is_causal", dict(is_causal=1), TypeError, "is_causal must be a bool, got int"
    yield (
        "backend",
        dict(backend="triton"),
        ValueError,
        r"backend must be one of \('auto', 'cuda', 'flex', 'cpu', 'reference'\), got 'triton'",
    )
    yield (
        "cuda on cpu",
        dict(backend="cuda"),
        ValueError,
        "backend='cuda' cannot run this call: inputs are on cpu, not cuda",
    )
    if torch.device("meta") != q.device:
        yield (
            "mask device",
            dict(attn_mask=torch.ones(1, 1, Q, K, dtype=torch.bool, device="meta")),
            ValueError,
            "attn_mask is on meta but query is on cpu",
        )


@pytest.mark.parametrize("case", list(_bad_cases()), ids=lambda c: c[0])
def test_bad_input_raises_clear_error(case):
    _, override, exc, pattern = case
    q, k, v = qkv()
    kw = dict(query=q, key=k, value=v)
    kw.update(override)
    with pytest.raises(exc, match=pattern):
        flexdma.flash_dma_attention(**kw)


def test_bad_input_on_direct_op_call_is_checked():
    q, k, v = qkv()
    with pytest.raises(RuntimeError, match="attn_mask must be bool"):
        torch.ops.flexdma.fwd(q, k, v, torch.ones(1, 1, 9, 11), None, 0.25, False, 0.0, False)
    with pytest.raises(RuntimeError, match="not divisible by kv heads"):
        torch.ops.flexdma.fwd(
            q,
            k[:, :, :1].expand(2, 11, 3, 16).contiguous(),
            v[:, :, :1].expand(2, 11, 3, 16).contiguous(),
            None,
            None,
            0.25,
            False,
            0.0,
            False,
        )


# ---------------------------------------------------------------- backends
def test_available_backends_lists_cpu_and_reference():
    names = flexdma.available_backends()
    assert names[-1] == "reference" and "cpu" in names
    assert ("cuda" in names) == (torch.cuda.is_available() and flexdma._ext.BUILD_INFO.WITH_CUDA)


def test_auto_on_cpu_uses_the_cpu_op(monkeypatch):
    q, k, v = qkv()
    call = _dispatch.Call.of(q, k, v, None, None, is_causal=False, softcap=0.0, requires_grad=True)
    assert _dispatch.select("auto", call) == "cpu"


def test_auto_fallback_warns_once_with_reason(monkeypatch):
    q, k, v = qkv()
    monkeypatch.setattr(_warnings, "_warned", set())
    monkeypatch.setattr(flexdma._ext, "LOAD_ERROR", "pretend the extension is missing")
    call = _dispatch.Call.of(q, k, v, None, None, is_causal=False, softcap=0.0, requires_grad=False)
    with pytest.warns(UserWarning, match="falls back from 'cpu' to 'reference': pretend the extension is missing"):
        assert _dispatch.select("auto", call) == "reference"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _dispatch.select("auto", call) == "reference"


def test_plans_are_kept_by_call_signature(monkeypatch):
    # A call of a signature seen before takes its plan without the support checks; what the plan
    # reads from outside the call (torch's deterministic algorithms) is part of the key, and a
    # changed call (a backward follows, another length) is planned again.
    q, k, v = qkv()
    bias = torch.randn(2, 2, 1, 11)
    of = functools.partial(_dispatch.Call.of, q, k, v, None, bias, is_causal=True, softcap=0.0, keep_window_size=4)
    first = _dispatch.plan("auto", of(requires_grad=False), False)
    decided = []
    monkeypatch.setattr(_dispatch, "_decide", lambda *a: decided.append(a) or first)
    assert _dispatch.plan("auto", of(requires_grad=False), False) is first
    assert decided == []
    _dispatch.plan("auto", of(requires_grad=True), False)
    _dispatch.plan("auto", of(requires_grad=False), True)
    assert len(decided) == 2
    was = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        _dispatch.plan("auto", of(requires_grad=False), False)
    finally:
        torch.use_deterministic_algorithms(was)
    assert len(decided) == 3
    short = _dispatch.Call.of(q, k[:, :7], v[:, :7], None, bias[..., :7], is_causal=True, softcap=0.0,
                              keep_window_size=4, requires_grad=False)  # fmt: skip
    _dispatch.plan("auto", short, False)
    assert len(decided) == 4 and decided[-1][1].seqlen_k == 7


def test_reference_backend_matches_attention_ref():
    q, k, v = qkv()
    bias = torch.randn(1, 2, 1, 11)
    out, lse = flexdma.flash_dma_attention(q, k, v, None, bias, is_causal=True, return_lse=True, backend="reference")
    ref, ref_lse = flexdma.attention_ref(q, k, v, None, bias, is_causal=True)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(lse, ref_lse)


def test_lower_dim_mask_is_left_padded():
    q, k, v = qkv()
    m2 = torch.rand(9, 11) > 0.3
    a = flexdma.flash_dma_attention(q, k, v, m2, backend="reference")
    b = flexdma.flash_dma_attention(q, k, v, m2[None, None], backend="reference")
    torch.testing.assert_close(a, b)


# ---------------------------------------------------------------- create_mask
def test_create_mask_topk_causal_and_ties():
    bias = torch.zeros(1, 1, 5, 8)  # all ties: the lowest visible key indices win
    m = flexdma.create_mask(bias, 2, is_causal=True)
    expected = torch.zeros(5, 8, dtype=torch.bool)
    expected[:, :2] = True
    assert torch.equal(m[0, 0], expected)
    bias = torch.randn(2, 2, 6, 10)
    m = flexdma.create_mask(bias, 3, is_causal=True)
    vis = flexdma.dense.naive.causal_mask(6, 10)
    assert m.shape == (2, 2, 6, 10) and not (m & ~vis).any()
    assert (m.sum(-1) == 3).all()
    # kept keys have the highest visible scores
    masked = bias.masked_fill(~vis, float("-inf"))
    kept_min = masked.masked_fill(~m, float("inf")).amin(-1)
    dropped_max = masked.masked_fill(m, float("-inf")).amax(-1)
    assert (kept_min >= dropped_max).all()


def test_create_mask_window_larger_than_keys_and_padding():
    bias = torch.randn(2, 1, 1, 6)
    pad = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
    m = flexdma.create_mask(bias, 100, attn_mask=pad, is_causal=True, query_len=3)
    assert m.shape == (2, 1, 3, 6)
    assert torch.equal(m[1, 0], flexdma.dense.naive.causal_mask(3, 6) & pad[1])
    m = flexdma.create_mask(bias, 2, attn_mask=pad, is_causal=False)
    assert m.shape == (2, 1, 1, 6) and (m.sum(-1) == 2).all() and not m[1, 0, 0, 4:].any()


def test_create_mask_block_size_selects_whole_blocks():
    bias = torch.randn(1, 1, 4, 16)
    m = flexdma.create_mask(bias, 8, block_size=4)
    blocks = m.view(1, 1, 4, 4, 4)
    assert (blocks.all(-1) | ~blocks.any(-1)).all()
    assert (m.sum(-1) == 8).all()


def test_create_mask_errors():
    with pytest.raises(ValueError, match="window_size must be a positive int, got 0"):
        flexdma.create_mask(torch.randn(1, 1, 4, 4), 0)
    with pytest.raises(ValueError, match="needs query_len"):
        flexdma.create_mask(torch.randn(1, 1, 1, 4), 2, is_causal=True)
    with pytest.raises(TypeError, match="attn_bias must be a floating-point tensor"):
        flexdma.create_mask(torch.ones(1, 1, 4, 4, dtype=torch.bool), 2)


# ---------------------------------------------------------------- compat
def test_compat_names_run_seed_code():
    q, k, v = qkv(dtype=torch.float64)
    bias = torch.randn(2, 2, 9, 11, dtype=torch.float64)
    mask = seed_create_mask(
        attention_bias=bias,
        attention_mask=None,
        batch_size=2,
        query_len=9,
        key_len=11,
        window_size=4,
        min_dtype=torch.finfo(torch.float64).min,
    )
    assert mask.dtype == torch.bool and mask.shape == (2, 2, 9, 11)
    func = flash_dmattn_func_auto(backend="reference")
    out = func(query=q, key=k, value=v, attn_mask=mask, attn_bias=bias, is_causal=True, softmax_scale=0.3)
    ref, _ = flexdma.attention_ref(q, k, v, mask, bias, is_causal=True, softmax_scale=0.3)
    torch.testing.assert_close(out, ref)
    out2 = flash_dmattn_func(q, k, v, mask, bias, scale=0.3, is_causal=True, backend="reference")
    torch.testing.assert_close(out2, ref)
    assert "cpu" in get_available_backends()
    with pytest.raises(ValueError, match="backend must be one of"):
        flash_dmattn_func_auto(backend="tpu")


# ---------------------------------------------------------------- compile / export
class Attn(torch.nn.Module):
    def forward(self, q, k, v, mask, bias):
        return flexdma.flash_dma_attention(q, k, v, mask, bias, is_causal=True)


def _graph_calls(gm: torch.fx.GraphModule) -> str:
    # Only the call targets: stable across versions, unlike generated names or code layout.
    lines = []
    for n in gm.graph.nodes:
        if n.op == "call_function":
            t = n.target
            name = (
                str(t)
                if isinstance(t, torch._ops.OpOverload) or isinstance(t, torch._ops.OpOverloadPacket)
                else f"{getattr(t, '__module__', '')}.{getattr(t, '__name__', t)}"
            )
            lines.append(re.sub(r"^_operator\.", "operator.", name))
    return "\n".join(lines)


class TestCompileExport(expecttest.TestCase):
    def test_compile_fullgraph_one_graph_one_op(self):
        torch._dynamo.reset()
        graphs = []

        def backend(gm, example_inputs):
            graphs.append(gm)
            return gm.forward

        q, k, v = qkv()
        bias = torch.randn(1, 2, 1, 11)
        mask = flexdma.create_mask(bias, 5, is_causal=True, query_len=9)
        compiled = torch.compile(Attn(), backend=backend, fullgraph=True)
        out = compiled(q, k, v, mask, bias)
        torch.testing.assert_close(out, Attn()(q, k, v, mask, bias))
        self.assertEqual(len(graphs), 1)
        self.assertExpectedInline(
            _graph_calls(graphs[0]),
            """\
flexdma.fwd
operator.getitem""",
        )

    def test_compile_inductor_trains(self):
        torch._dynamo.reset()
        q, k, v = (t.requires_grad_() for t in qkv())
        bias = torch.randn(2, 2, 9, 11, requires_grad=True)
        compiled = torch.compile(Attn(), fullgraph=True)
        out = compiled(q, k, v, None, bias)
        out.sum().backward()
        grads = [t.grad.clone() for t in (q, k, v, bias)]
        for t in (q, k, v, bias):
            t.grad = None
        Attn()(q, k, v, None, bias).sum().backward()
        for g, t in zip(grads, (q, k, v, bias)):
            torch.testing.assert_close(g, t.grad)

    def test_export_keeps_one_node(self):
        q, k, v = qkv()
        bias = torch.randn(1, 2, 9, 11)
        mask = torch.rand(2, 1, 9, 11) > 0.2
        ep = torch.export.export(Attn(), (q, k, v, mask, bias))
        ops = [n.target for n in ep.graph.nodes if n.op == "call_function"]
        self.assertEqual(ops.count(torch.ops.flexdma.fwd.default), 1)
        torch.testing.assert_close(ep.module()(q, k, v, mask, bias), Attn()(q, k, v, mask, bias))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_auto_on_cuda_falls_back_for_unsupported_head_dim(monkeypatch):
    monkeypatch.setattr(_warnings, "_warned", set())
    # FlexAttention takes head_dim 16 and 40 keys; the CUDA kernels implement 32, 64, 96, 128, 192, 256 only.
    q, k, v = qkv(Q=24, K=40, D=16, dtype=torch.bfloat16, device="cuda")
    with pytest.warns(UserWarning, match=r"falls back from 'cuda' to 'flex': .*head_dim 16"):
        call = _dispatch.Call.of(q, k, v, None, None, is_causal=True, softcap=0.0, requires_grad=False)
        name = _dispatch.select("auto", call)
    assert name == "flex"
    out = flexdma.flash_dma_attention(q, k, v, is_causal=True)
    ref, _ = flexdma.attention_ref(q.double(), k.double(), v.double(), is_causal=True)
    assert (out.double() - ref).abs().max() < 3e-2


def test_the_kernels_own_support_check_is_what_python_reads():
    # flexdma._C.cuda_unsupported_reason is C++ cuda::unsupported_reason where the extension has
    # CUDA kernels: no copy of its rules in Python.
    from flexdma import _ext

    check = _ext.C.cuda_unsupported_reason
    if not _ext.with_cuda():
        assert check(1, 2, 1, 64, 2, 0.0) == "flexdma was built without CUDA kernels"
        return
    built = list(_ext.BUILD_INFO.CUDA_HEAD_DIMS)
    assert check(1, 2, 1, built[0], 2, 0.0) is None
    assert check(1, 2, 1, built[0], 3, 0.0) is None
    assert "dtype" in check(1, 2, 1, built[0], 0, 0.0)
    assert "dtype" in check(1, 2, 1, built[0], -1, 0.0)
    assert "head_dim" in check(1, 2, 1, 80, 2, 0.0)
    assert "num_heads" in check(1, 3, 2, built[0], 2, 0.0)
    assert "65535" in check(70000, 2, 1, built[0], 2, 0.0)
