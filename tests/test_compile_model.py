"""The compiler stack on a small DMA transformer: torch.compile(fullgraph), torch.export with a
dynamic sequence length, and an AOTInductor package."""

import copy

import pytest
import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

import flexdma
from flexdma import _ext
from flexdma.examples.mqar import DMALanguageModel

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
VOCAB = 32


def _model(device, **kw):
    # keep_window_size below the sequence lengths used, so the top-k selection is part of the graph.
    if device == "cuda":
        if "cuda" not in flexdma.available_backends():
            pytest.skip("flexdma was built without its CUDA kernels")
        # bf16 with head_dim 64: a call the CUDA kernels take, so their ops are what gets traced.
        return DMALanguageModel(
            VOCAB, dim=128, num_layers=2, num_heads=2, num_kv_heads=1, keep_window_size=6, backend="cuda", **kw
        ).to(device, torch.bfloat16)
    if "cpu" not in flexdma.available_backends():
        pytest.skip("flexdma was built without its CPU kernel")
    return DMALanguageModel(
        VOCAB, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, keep_window_size=6, backend="cpu", **kw
    ).to(device)


def _tol(device):
    # CUDA runs in bf16: compiled and eager graphs round intermediate activations differently.
    return 5e-2 if device == "cuda" else 1e-5


class GraphRecorder:
    """torch.compile backend that keeps the AOT forward/backward FX graphs and runs them as is."""

    def __init__(self):
        self.forward, self.backward = [], []
        self.backend = aot_autograd(fw_compiler=self._keep(self.forward), bw_compiler=self._keep(self.backward))

    @staticmethod
    def _keep(store):
        def compiler(gm, example_inputs):
            store.append(gm)
            return make_boxed_func(gm.forward)

        return compiler


def _targets(graphs):
    return {str(n.target) for gm in graphs for n in gm.graph.nodes if n.op == "call_function"}


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph_training(device):
    torch._dynamo.reset()
    model = _model(device)
    eager = copy.deepcopy(model)
    rec = GraphRecorder()
    compiled = torch.compile(model, fullgraph=True, backend=rec.backend)
    opt_c = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt_e = torch.optim.AdamW(eager.parameters(), lr=1e-2)
    losses = []
    tokens = torch.randint(VOCAB, (2, 12), device=device)  # one batch, so the loss must go down
    for _ in range(4):
        step_losses = []
        for m, opt in ((compiled, opt_c), (eager, opt_e)):
            loss = torch.nn.functional.cross_entropy(m(tokens)[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
            step_losses.append(loss.item())
        losses.append(step_losses)
    # One graph per direction (fullgraph=True would have raised on a break; same shapes, no recompile).
    assert len(rec.forward) == 1 and len(rec.backward) == 1
    # DynamicMaskAttention's scores are per key: the per-key ops, no dense mask in the graph.
    assert {"flexdma.perkey_select.default", "flexdma.perkey_fwd.default"} <= _targets(rec.forward)
    assert "flexdma.perkey_bwd.default" in _targets(rec.backward)
    for c, e in losses:
        assert abs(c - e) <= 10 * _tol(device) * max(1.0, abs(e)), losses
    assert losses[-1][0] < losses[0][0]


def test_compile_dynamic_training_on_cpu():
    """torch.compile(model, dynamic=True): every size symbolic, head_dim too, so the default scale
    1/sqrt(head_dim) is a symbolic float; the scalar checks must trace it (math.isfinite on it
    stopped the graph). Two lengths, one graph, the eager model's logits and gradients."""
    torch._dynamo.reset()
    model = _model("cpu")
    eager = copy.deepcopy(model)
    rec = GraphRecorder()
    compiled = torch.compile(model, fullgraph=True, dynamic=True, backend=rec.backend)
    for length in (12, 20):
        tokens = torch.randint(VOCAB, (2, length))
        got, want = compiled(tokens), eager(tokens)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        got.square().sum().backward()
        want.square().sum().backward()
    for (name, p), e in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, e.grad, atol=1e-4, rtol=1e-4, msg=name)
    assert len(rec.forward) == 1 and len(rec.backward) == 1
    torch._dynamo.reset()


@pytest.fixture(scope="module", params=DEVICES)
def exported(request):
    torch.manual_seed(0)
    model = _model(request.param).eval()
    seq = torch.export.Dim("seq", min=8, max=64)
    tokens = torch.randint(VOCAB, (2, 12), device=request.param)
    ep = torch.export.export(model, (tokens,), dynamic_shapes={"tokens": {1: seq}})
    return model, ep, request.param


@pytest.mark.parametrize("seqlen", [9, 12, 33])
def test_export_dynamic_seqlen(exported, seqlen):
    model, ep, device = exported
    assert sum(str(n.target) == "flexdma.perkey_fwd.default" for n in ep.graph.nodes) == 2
    tokens = torch.randint(VOCAB, (2, seqlen), device=device)
    with torch.no_grad():
        torch.testing.assert_close(ep.module()(tokens), model(tokens), atol=_tol(device), rtol=_tol(device))


def test_aoti_package_runs(exported, tmp_path):
    # The flexdma op has no Inductor lowering: the AOTI runtime calls its registered C++ kernel
    # (CPU or CUDA) through the proxy executor, which this checks end to end.
    model, ep, device = exported
    path = torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp_path / "dma.pt2"))
    runner = torch._inductor.aoti_load_package(path)
    for seqlen in (10, 27):
        tokens = torch.randint(VOCAB, (2, seqlen), device=device)
        with torch.no_grad():
            torch.testing.assert_close(runner(tokens), model(tokens), atol=_tol(device), rtol=_tol(device))


def test_capability_lookup_compiles_once(monkeypatch):
    """The per-key route asks for the GPU's capability and the C++ kernels' check inside the traced
    model (route.kernels_reason); a lookup that fills its cache while traced leaves a guard on the
    empty cache, and the second call compiles again (the CUDA fullgraph test above saw two graphs).
    Simulated on CPU: a CUDA build and an sm_90 device."""
    from torch._dynamo.testing import CompileCounter

    from flexdma import _device, _dispatch, _ext
    from flexdma.perkey import route

    monkeypatch.setattr(_ext, "with_cuda", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))
    monkeypatch.setattr(_device, "_CAPABILITY", {})
    monkeypatch.setattr(_ext, "_REASONS", {})
    torch._dynamo.reset()
    counter = CompileCounter()
    q, k, v = (torch.ones(1, 8, 2, 64, dtype=torch.bfloat16) for _ in range(3))
    bias = torch.ones(1, 2, 1, 8, dtype=torch.bfloat16)
    call = _dispatch.Call.of(q, k, v, None, bias, is_causal=True, softcap=0.0, keep_window_size=4, requires_grad=False)
    call = call._replace(device=torch.device("cuda", 0))

    @torch.compile(backend=counter, fullgraph=True)
    def f(x):
        return x * (2 if route.kernels_reason(call, False, False) is None else 3)

    got = [f(torch.ones(3)) for _ in range(3)]
    # Asked eagerly only now: the traced lookups filled the caches.
    want = 2.0 if route.kernels_reason(call, False, False) is None else 3.0
    assert all(torch.equal(g, torch.full((3,), want)) for g in got)
    assert counter.frame_count == 1
    torch._dynamo.reset()


def test_kernel_checks_are_asked_constants_under_dynamic_shapes():
    """The kernels' checks run eagerly while dynamo traces (kernels_reason is assumed constant), so
    their key must be constants: a dynamic size is asked as 0 (_ext.known_size; the ops check the
    real size before they launch). The compiled Doge step over packed rows, whose sequence count is
    dynamic, failed on CUDA with 'SymNodeVariable() is not a constant' without it."""
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()

    @torch.compile(backend=counter, fullgraph=True, dynamic=True)
    def f(x):
        # (_ext a global and the dtype code looked up in here, as in flexdma: what a traced frame
        # closes over can be made dynamic too)
        bf16 = _ext.DTYPE_CODES[torch.bfloat16]
        n, length = _ext.known_size(x.shape[0]), _ext.known_size(x.shape[1])
        key = (n, 2, 1, 64, length, length, bf16, bf16, 0.0, True, length, 90, True, False)
        return x * (2 if _ext.kernels_reason("perkey_unsupported_reason", key) is None else 3), n

    torch._dynamo.reset()
    for shape in ((3, 5), (4, 7), (2, 9)):
        out, asked = f(torch.ones(shape))
        assert asked == 0
        assert out.shape == shape
    assert _ext.known_size(7) == 7  # eagerly, the size itself
    torch._dynamo.reset()
