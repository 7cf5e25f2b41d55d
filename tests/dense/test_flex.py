"""The FlexAttention backend against the float64 reference: the BlockMask built from a dense mask,
the forward on CPU (and GPU), the CPU backward route (flex forward, flexdma op backward), the GPU
backward with dbias, and no recompilation when only mask / bias contents change."""

from __future__ import annotations

import sys

import pytest
import torch
from utils import assert_close_to_ref, make_mask_bias, make_qkv, reference_with_grads, requires_cuda

flex = pytest.importorskip("flexdma.dense.flex")
from torch.nn.attention.flex_attention import create_block_mask  # noqa: E402


def _ref_kw(is_causal, D, softcap=0.0):
    return dict(is_causal=is_causal, softmax_scale=D**-0.5, softcap=softcap)


# ------------------------------------------------------------------------------ BlockMask
def _create_block_mask_ref(mask, Q, K, H, is_causal):
    """create_block_mask over the same dense mask: the slow construction we replace."""
    Hm = mask.shape[1]
    g = H // Hm if Hm > 1 else 1
    off = K - Q

    def mask_mod(b, h, q, k):
        keep = mask[b if mask.shape[0] > 1 else 0, h // g if Hm > 1 else 0, q if mask.shape[2] > 1 else 0, k]
        return (keep & (k <= q + off)) if is_causal else keep

    return create_block_mask(mask_mod, mask.shape[0], H if Hm > 1 else 1, Q, K, device="cpu", BLOCK_SIZE=128)


def _sets(num, idx):
    """Selected tile sets per (b, h, q-tile): the order within a row is not part of the contract."""
    num, idx = num.cpu(), idx.cpu()
    return [
        [[sorted(idx[b, h, r, : num[b, h, r]].tolist()) for r in range(num.shape[2])] for h in range(num.shape[1])]
        for b in range(num.shape[0])
    ]


@pytest.mark.parametrize("Q,K", [(256, 256), (300, 200), (130, 513), (384, 640)])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("kind", ["random", "blocky", "per_key"])
def test_block_mask_matches_create_block_mask(Q, K, is_causal, kind):
    torch.manual_seed(Q * 7 + K)
    H = 2
    if kind == "random":
        mask = torch.rand(2, H, Q, K) < 0.3
    elif kind == "blocky":
        # Whole tiles on and off plus a few holes: exercises full vs partial vs skipped.
        tiles = torch.rand(2, H, -(-Q // 128), -(-K // 128)) < 0.5
        mask = tiles.repeat_interleave(128, 2).repeat_interleave(128, 3)[:, :, :Q, :K].clone()
        mask[0, 0, 3, 5] = False
    else:
        mask = torch.rand(2, 1, 1, K) < 0.5
        mask[..., :128] = True
    ours = flex.block_mask_from_dense(mask, Q, K, H, is_causal, mask_mod=None)
    ref = _create_block_mask_ref(mask, Q, K, H, is_causal)
    assert ours.seq_lengths == (Q, K)
    for a, b in [("kv_num_blocks", "kv_indices"), ("full_kv_num_blocks", "full_kv_indices")]:
        ours_n, ref_n = getattr(ours, a), getattr(ref, a)
        # create_block_mask keeps tiles cut by the sequence end "full" when in range; ours keeps
        # them partial. Compare the union (visited tiles) always, and the split on interior tiles.
        assert ours_n.shape[-1] == ref_n.shape[-1]

    def visited(bm):
        return [
            [[sorted(set(p) | set(f)) for p, f in zip(pr, fr)] for pr, fr in zip(ph, fh)]
            for ph, fh in zip(_sets(bm.kv_num_blocks, bm.kv_indices), _sets(bm.full_kv_num_blocks, bm.full_kv_indices))
        ]

    ref_visited = visited(ref)
    if len(ref_visited[0]) == 1 and H > 1:
        ref_visited = [[h[0]] * H for h in ref_visited]
    ours_visited = visited(ours)
    if len(ours_visited[0]) == 1 and H > 1:
        ours_visited = [[h[0]] * H for h in ours_visited]
    assert ours_visited == ref_visited
    if Q % 128 == 0 and K % 128 == 0:
        ours_full = _sets(ours.full_kv_num_blocks, ours.full_kv_indices)
        ref_full = _sets(ref.full_kv_num_blocks, ref.full_kv_indices)
        if len(ours_full[0]) != len(ref_full[0]):
            ours_full = [[h[0]] * H for h in ours_full] if len(ours_full[0]) == 1 else ours_full
            ref_full = [[h[0]] * H for h in ref_full] if len(ref_full[0]) == 1 else ref_full
        assert ours_full == ref_full


def _tile_masks(Q, K, gen):
    """Masks with every layout the kernel must read: full, broadcast and expanded (0-stride)
    dims, a non-contiguous view, plus tile-sized blocks so that full tiles occur."""
    nq, nk = -(-Q // 128), -(-K // 128)
    tiles = torch.rand(2, 2, nq, nk, generator=gen) < 0.5
    blocky = tiles.repeat_interleave(128, 2).repeat_interleave(128, 3)[:, :, :Q, :K].clone()
    blocky[0, 0, min(3, Q - 1), min(5, K - 1)] = False
    holes = blocky & (torch.rand(2, 2, Q, K, generator=gen) < 0.995)
    return {
        "random": torch.rand(2, 2, Q, K, generator=gen) < 0.3,
        "blocky": blocky,
        "holes": holes,
        "per_key": torch.rand(2, 1, 1, K, generator=gen) < 0.5,
        "batch_bcast": (torch.rand(1, 2, Q, K, generator=gen) < 0.9),
        "expanded": (torch.rand(1, 1, Q, K, generator=gen) < 0.97).expand(2, 2, Q, K),
        "key_bcast": torch.ones(2, 2, Q, 1, dtype=torch.bool).expand(2, 2, Q, K),
        "transposed": (torch.rand(2, 2, K, Q, generator=gen) < 0.98).transpose(-1, -2),
        "none": None,
    }


TILE_SHAPES = [(256, 256), (300, 200), (130, 513), (1, 129), (200, 1)]


def _check_block_tiles(is_causal):
    """Runs in a child process with TRITON_INTERPRET=1 (the mode is fixed when triton is imported):
    the tile kernel against the torch tile reduction, the index kernel against the stable sort."""
    from flexdma.dense import _block_tiles

    for Q, K in TILE_SHAPES:
        gen = torch.Generator().manual_seed(Q * 31 + K)
        for name, mask in _tile_masks(Q, K, gen).items():
            want = flex._tile_flags_torch(mask, Q, K, is_causal, torch.device("cpu"))
            # Both interior-tile loops; few large chunks, as the interpreter's cost is per chunk.
            early = _block_tiles.tile_flags(mask, Q, K, is_causal, device="cpu", rows=64, early_exit=True)
            got = _block_tiles.tile_flags(mask, Q, K, is_causal, device="cpu", rows=128, early_exit=False)
            for g, w in zip(early, want):
                assert torch.equal(g, w.expand_as(g)), (Q, K, is_causal, name, "early exit")
            for g, w, what in zip(got, want, ("partial", "full")):
                assert torch.equal(g, w.expand_as(g)), (Q, K, is_causal, name, what)
                if name not in ("random", "blocky", "per_key"):
                    continue
                for t in (g, g.transpose(-1, -2)):  # kv side, q side
                    for a, b in zip(_block_tiles.ordered(t), flex._ordered(t)):
                        assert torch.equal(a, b), (Q, K, is_causal, name, what, "ordered")


def test_block_tiles_kernel_interpreted_on_cpu():
    """The Triton kernels (CUDA path) against the torch code (CPU path), on CPU through Triton's
    interpreter: odd Q/K, Q != K, broadcast / 0-stride / transposed masks, causal on and off."""
    pytest.importorskip("triton")
    import os
    import subprocess

    here = os.path.dirname(os.path.abspath(__file__))
    tests_dir = os.path.dirname(here)  # utils.py, which test_flex imports
    # The child imports flexdma the way this process did (an editable install may point elsewhere).
    pkg_root = os.path.dirname(
        os.path.dirname(os.path.dirname(os.path.abspath(flex.__file__)))
    )  # flexdma/dense/flex.py
    env = dict(
        os.environ,
        TRITON_INTERPRET="1",
        PYTHONPATH=os.pathsep.join(p for p in (here, tests_dir, pkg_root, os.environ.get("PYTHONPATH")) if p),
    )
    # One child per causal setting, run side by side: the interpreter is slow.
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", f"import test_flex; test_flex._check_block_tiles({c})"],
            env=env,
            cwd=here,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for c in (False, True)
    ]
    for p in procs:
        out, _ = p.communicate(timeout=600)
        assert p.returncode == 0, out[-3000:]


@requires_cuda
@pytest.mark.parametrize("is_causal", [False, True])
def test_block_tiles_cuda_vs_torch_path(is_causal):
    """The CUDA path (Triton kernel when triton is there) against the torch path, all eight tensors."""
    for Q, K in TILE_SHAPES:
        gen = torch.Generator().manual_seed(Q * 31 + K)
        for name, mask in _tile_masks(Q, K, gen).items():
            dev = None if mask is None else mask.cuda()
            got = flex._block_tensors(dev, Q, K, 4, is_causal, device="cuda")
            want = flex._block_tensors(mask, Q, K, 4, is_causal, device="cpu")
            for i, (g, w) in enumerate(zip(got, want)):
                assert torch.equal(g.cpu(), w.expand_as(g)), (Q, K, name, i)


# ------------------------------------------------------------------------------ forward
CPU_CASES = [
    # (B, Q, K, H, KVH, D, mask pattern, bias pattern, causal, softcap)
    (1, 200, 300, 4, 2, 64, ("B", "KVH", "Q", "K"), ("1", "H", "Q", "K"), False, 0.0),
    (2, 200, 300, 4, 2, 64, ("B", "KVH", "Q", "K"), ("1", "H", "Q", "K"), True, 5.0),
    (2, 200, 300, 4, 2, 64, ("1", "1", "1", "K"), ("B", "1", "1", "K"), True, 0.0),
    (2, 200, 300, 4, 2, 64, None, ("1", "KVH", "Q", "1"), False, 0.0),
    (2, 200, 300, 4, 2, 64, ("B", "H", "Q", "K"), None, True, 0.0),
    # Q, K multiples of 128: the mask_mod without bounds checks / clamps.
    (1, 256, 384, 2, 1, 32, ("1", "1", "Q", "K"), ("1", "1", "Q", "K"), True, 0.0),
]


def _check_forward(device, dtype, case, empty_rows=False):
    B, Q, K, H, KVH, D, mp, bp, causal, softcap = case
    q, k, v = make_qkv(B, Q, K, H, KVH, D, dtype=dtype, device=device)
    mask, bias = make_mask_bias(mp, bp, B=B, H=H, KVH=KVH, Q=Q, K=K, dtype=dtype, device=device, empty_rows=empty_rows)
    kw = _ref_kw(causal, D, softcap)
    out, lse = flex.flex_dma_attention(q, k, v, mask, bias, is_causal=causal, softmax_scale=D**-0.5, softcap=softcap)
    from flexdma.dense.naive import attention_ref

    ref64 = attention_ref(q.double(), k.double(), v.double(), mask, None if bias is None else bias.double(), **kw)
    reflp = attention_ref(q, k, v, mask, bias, **kw)
    assert out.dtype == dtype and lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert_close_to_ref(out, ref64[0], reflp[0], "out")
    assert_close_to_ref(lse, ref64[1], reflp[1].float() if dtype != torch.float32 else None, "lse")
    return q, k, v, mask, bias, out


@pytest.mark.parametrize("case", CPU_CASES)
def test_cpu_forward(case):
    torch.manual_seed(0)
    _check_forward("cpu", torch.float32, case, empty_rows=case[6] is not None)


def test_cpu_forward_no_lse_is_compiled_and_matches():
    torch.manual_seed(1)
    case = CPU_CASES[1]
    q, k, v, mask, bias, out = _check_forward("cpu", torch.float32, case, empty_rows=True)
    out2, lse2 = flex.flex_dma_attention(
        q, k, v, mask, bias, is_causal=True, softmax_scale=64**-0.5, softcap=5.0, need_lse=False
    )
    assert lse2 is None
    torch.testing.assert_close(out2, out, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------ CPU backward
@pytest.mark.parametrize("case", [CPU_CASES[1], CPU_CASES[2]])
def test_cpu_backward_route(case):
    pytest.importorskip("flexdma._C")
    torch.manual_seed(2)
    B, Q, K, H, KVH, D, mp, bp, causal, softcap = case
    q, k, v = make_qkv(B, Q, K, H, KVH, D, requires_grad=True)
    mask, bias = make_mask_bias(mp, bp, B=B, H=H, KVH=KVH, Q=Q, K=K, empty_rows=True, bias_requires_grad=True)
    out, lse = flex.flex_dma_attention(q, k, v, mask, bias, is_causal=causal, softmax_scale=D**-0.5, softcap=softcap)
    g = torch.randn_like(out)
    dq, dk, dv, db = torch.autograd.grad(out, (q, k, v, bias), g)
    ref = reference_with_grads(
        q, k, v, mask, bias, g, dtype=torch.float64, bias_grad=True, **_ref_kw(causal, D, softcap)
    )
    for name, x in dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv, dbias=db).items():
        assert x.shape == ref[name].shape, name
        assert_close_to_ref(x, ref[name], None, name)


def test_cpu_block_mask_traces_under_torch_compile_fullgraph():
    # The tile classification runs inside the user's graph when the flex backend is traced:
    # it must not take a data-dependent size (nonzero) or branch on tensor values.
    import flexdma

    torch.manual_seed(4)
    q, k, v = make_qkv(1, 300, 340, 2, 1, 16)
    mask = torch.rand(1, 1, 300, 340) < 0.3

    def f(q, k, v, mask):
        return flexdma.flash_dma_attention(q, k, v, mask, is_causal=True, backend="flex")

    with torch.no_grad():
        torch._dynamo.reset()
        out = torch.compile(f, backend="eager", fullgraph=True)(q, k, v, mask)
        torch.testing.assert_close(out, f(q, k, v, mask), atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------ recompiles
def test_no_recompile_for_new_contents():
    import torch._dynamo.utils as dyn_utils

    torch.manual_seed(3)
    B, Q, K, H, KVH, D = 1, 130, 260, 2, 1, 32
    q, k, v = make_qkv(B, Q, K, H, KVH, D)

    def step():
        mask, bias = make_mask_bias(("1", "1", "Q", "K"), ("1", "1", "Q", "K"), B=B, H=H, KVH=KVH, Q=Q, K=K)
        return flex.flex_dma_attention(
            q, k, v, mask, bias, is_causal=True, softmax_scale=D**-0.5, softcap=0.0, need_lse=False
        )[0]

    step()  # compile
    before = dyn_utils.counters["stats"]["unique_graphs"]
    frames_before = dyn_utils.counters["frames"]["total"], dyn_utils.counters["frames"]["ok"]
    for _ in range(3):
        step()
    assert dyn_utils.counters["stats"]["unique_graphs"] == before
    assert dyn_utils.counters["frames"]["ok"] == frames_before[1]


def test_unsupported_reason():
    q = torch.randn(1, 4, 2, 24)
    assert "head_dim" in flex.unsupported_reason(q, q, q, None, None, is_causal=False, softcap=0.0, requires_grad=False)
    q = torch.randn(1, 4, 2, 32)
    assert flex.unsupported_reason(q, q, q, None, None, is_causal=False, softcap=0.0, requires_grad=False) is None


# ------------------------------------------------------------------------------ GPU
GPU_CASES = [
    (2, 256, 256, 4, 2, 64, ("B", "KVH", "Q", "K"), ("1", "H", "Q", "K"), True, 0.0),
    (1, 200, 333, 4, 1, 128, ("1", "1", "Q", "K"), ("1", "1", "Q", "K"), True, 0.0),
    (2, 300, 200, 2, 2, 128, ("1", "1", "1", "K"), ("B", "1", "1", "K"), False, 10.0),
    (1, 257, 257, 2, 1, 256, ("1", "1", "Q", "K"), ("1", "KVH", "Q", "1"), True, 0.0),
]


@requires_cuda
# One compile per shape family: bf16 everywhere, fp16 on one shape.
@pytest.mark.parametrize("case,dtype", [(c, torch.bfloat16) for c in GPU_CASES] + [(GPU_CASES[0], torch.float16)])
def test_gpu_forward_backward(case, dtype):
    torch.manual_seed(4)
    B, Q, K, H, KVH, D, mp, bp, causal, softcap = case
    q, k, v = make_qkv(B, Q, K, H, KVH, D, dtype=dtype, device="cuda", requires_grad=True)
    mask, bias = make_mask_bias(
        mp, bp, B=B, H=H, KVH=KVH, Q=Q, K=K, dtype=dtype, device="cuda", empty_rows=True, bias_requires_grad=True
    )
    out, lse = flex.flex_dma_attention(q, k, v, mask, bias, is_causal=causal, softmax_scale=D**-0.5, softcap=softcap)
    g = torch.randn_like(out)
    dq, dk, dv, db = torch.autograd.grad(out, (q, k, v, bias), g)
    kw = _ref_kw(causal, D, softcap)
    ref = reference_with_grads(q, k, v, mask, bias, g, dtype=torch.float64, bias_grad=True, **kw)
    low = reference_with_grads(q, k, v, mask, bias, g, dtype=dtype, bias_grad=True, **kw)
    factor = 3.0 if softcap > 0 else 2.0
    got = dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv, dbias=db)
    for name, x in got.items():
        assert torch.isfinite(x).all() or name == "lse", name
        # The LSE is accumulated in float32 either way: held to the float32 tolerance.
        lowp = None if name == "lse" else low[name]
        assert_close_to_ref(x, ref[name], lowp, name, factor=factor)


def test_kernel_options_follow_the_measurements(monkeypatch):
    # Where a (capability, head dim, dtype, training) was measured, its choice; elsewhere the small
    # blocks for training (they fit every head dim) and the defaults for inference; defaults whose
    # forward raised a resource error give way to options that fit.
    from flexdma.dense import flex

    monkeypatch.setattr(flex, "device_capability", lambda device: (9, 0))
    monkeypatch.setattr(flex, "MEASURED_OPTIONS", {((9, 0), 128, 2, True): None})
    monkeypatch.setattr(flex, "_DEFAULTS_FAILED", set())
    cuda = torch.device("cuda", 0)
    assert flex.kernel_options(torch.device("cpu"), 128, torch.bfloat16, True) is None
    assert flex.kernel_options(cuda, 128, torch.bfloat16, True) is None
    assert flex.kernel_options(cuda, 64, torch.bfloat16, True) == flex.SMALL_BLOCKS
    assert flex.kernel_options(cuda, 64, torch.bfloat16, False) is None
    flex._DEFAULTS_FAILED.update({((9, 0), 128, 2, True), ((9, 0), 64, 2, False)})
    assert flex.kernel_options(cuda, 128, torch.float16, False) is None  # unmeasured inference: defaults
    assert flex.kernel_options(cuda, 128, torch.bfloat16, True) == flex.SMALL_BLOCKS
    assert flex.kernel_options(cuda, 64, torch.bfloat16, False) == flex.ONE_STAGE


def test_sm90_head_dim_64_takes_the_64_key_forward_tile(monkeypatch):
    # FlexAttention's sm_90 default forward tile at head dim 64 (128 x 128, four warps) is the slow
    # case with a captured bias: every 16-bit call there, general or sparse mask, inference or
    # training, narrows the forward's key tile and leaves the backward's tiles (no bwd_ / unprefixed
    # keys) as they are; head dim 128 and other devices keep their choices.
    from flexdma.dense import flex

    monkeypatch.setattr(flex, "device_capability", lambda device: (9, 0))
    monkeypatch.setattr(flex, "_DEFAULTS_FAILED", set())
    cuda = torch.device("cuda", 0)
    for dtype in (torch.bfloat16, torch.float16):
        for training in (False, True):
            assert flex.kernel_options(cuda, 64, dtype, training) == flex.KEY_TILE_64
            assert flex.sparse_mask_kernel_options(cuda, 64, dtype, training) == flex.KEY_TILE_64
    assert all(k.startswith("fwd_") for k in flex.KEY_TILE_64)
    assert flex.kernel_options(cuda, 128, torch.bfloat16, False) is None
    assert flex.sparse_mask_kernel_options(cuda, 128, torch.bfloat16, False) is None
    assert flex.sparse_mask_kernel_options(cuda, 64, torch.float32, False) is None
    monkeypatch.setattr(flex, "device_capability", lambda device: (8, 0))
    assert flex.sparse_mask_kernel_options(cuda, 64, torch.bfloat16, False) is None


def test_resource_errors_are_recognised_through_wrappers():
    from flexdma.dense import flex

    class OutOfResources(Exception):
        pass

    try:
        try:
            raise OutOfResources("shared memory, Required: 328704, Hardware limit: 232448")
        except OutOfResources as inner:
            raise RuntimeError("Inductor: kernel launch failed") from inner
    except RuntimeError as e:
        assert flex._is_resource_error(e)
    assert not flex._is_resource_error(ValueError("something else"))


def test_limits_name_the_calls_flexattention_cannot_take():
    # The dispatcher's fallback chain (cuda -> flex -> reference) skips FlexAttention for these, with
    # the reason in its one-time warning.
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert flex.limits_reason(cuda, torch.float64, 64, 64, 64, None) == "float64 on CUDA"
    assert flex.limits_reason(cpu, torch.float64, 64, 64, 64, None) is None
    assert flex.limits_reason(cuda, torch.bfloat16, 64, 64, 64, None) is None
    assert "head_dim 48" in flex.limits_reason(cuda, torch.bfloat16, 64, 64, 48, None)
    assert flex.limits_reason(cuda, torch.bfloat16, 64, 8, 64, None) == "seqlen_k 8 < 16 on CUDA"
    assert flex.limits_reason(cpu, torch.float16, 64, 64, 64, None) == "float16 on CPU"
