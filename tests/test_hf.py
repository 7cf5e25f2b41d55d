"""attn_implementation="flexdma" in Hugging Face transformers models matches their eager attention."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

import flexdma.integrations.transformers as fx  # noqa: E402

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
# The models' sizes: small ones for the comparisons with eager attention, tiny ones to compile.
SMALL = dict(
    vocab_size=100,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
TINY = dict(
    vocab_size=100,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
)


@pytest.fixture(scope="module", autouse=True)
def _registered():
    fx.register()


def _inputs(device):
    ids = torch.randint(100, (2, 12), device=device)
    am = torch.ones(2, 12, dtype=torch.long, device=device)
    am[1, :3] = 0  # left padding
    return ids, am


def _compare(model, device, train_bias=False):
    ids, am = _inputs(device)
    outs, grads = {}, {}
    for impl in ("eager", "flexdma"):
        model.set_attn_implementation(impl)
        model.zero_grad()
        logits = model(input_ids=ids, attention_mask=am).logits
        logits[am.bool()].square().sum().backward()
        outs[impl] = logits.detach()
        grads[impl] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    real = am.bool()
    torch.testing.assert_close(outs["flexdma"][real], outs["eager"][real], atol=1e-5, rtol=1e-4)
    assert grads["flexdma"].keys() == grads["eager"].keys()
    for n, g in grads["eager"].items():
        torch.testing.assert_close(grads["flexdma"][n], g, atol=1e-4, rtol=1e-3, msg=lambda m: f"{n}: {m}")


@pytest.mark.parametrize("device", DEVICES)
def test_llama_matches_eager(device):
    cfg = transformers.LlamaConfig(**SMALL)
    _compare(transformers.LlamaForCausalLM(cfg).to(device), device)


@pytest.mark.parametrize("device", DEVICES)
def test_doge_matches_eager(device):
    if not hasattr(transformers, "DogeForCausalLM"):
        pytest.skip("this transformers has no Doge model")
    cfg = transformers.DogeConfig(**SMALL, keep_window_size=5)
    model = transformers.DogeForCausalLM(cfg).to(device)
    with torch.no_grad():
        # A = 0 (the init) makes every key equally important; random A gives a real dynamic mask
        # without ties.
        for layer in model.model.layers:
            layer.self_attn.A.normal_()
    _compare(model, device)


def test_generate_with_cache_matches_eager():
    cfg = transformers.LlamaConfig(**SMALL)
    model = transformers.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(100, (1, 6))
    seqs = {}
    for impl in ("eager", "flexdma"):
        model.set_attn_implementation(impl)
        seqs[impl] = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(seqs["flexdma"], seqs["eager"])


def test_attention_function_layouts():
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 7, 8), torch.randn(2, 2, 7, 8)
    module = torch.nn.Module()
    module.is_causal = True
    out, w = fx.flexdma_attention_forward(module, q, k, v, None, scaling=0.3)
    assert w is None and out.shape == (2, 5, 4, 8)
    ref = fx.flash_dma_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, softmax_scale=0.3, backend="reference"
    )
    torch.testing.assert_close(out, ref)
    # bool and additive float masks mean the same thing
    keep = torch.rand(2, 1, 5, 7) < 0.7
    keep[..., 0] = True
    add = torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)
    o1, _ = fx.flexdma_attention_forward(module, q, k, v, keep)
    o2, _ = fx.flexdma_attention_forward(module, q, k, v, add)
    torch.testing.assert_close(o1, o2)


def _tiny(name):
    if name == "doge":
        if not hasattr(transformers, "DogeForCausalLM"):
            pytest.skip("this transformers has no Doge model")
        cfg = transformers.DogeConfig(**TINY, keep_window_size=5)
        model = transformers.DogeForCausalLM(cfg)
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.A.normal_()
        return model
    cfg = transformers.LlamaConfig(**TINY)
    return transformers.LlamaForCausalLM(cfg)


@pytest.mark.parametrize("name", ["doge", "llama"])
def test_compile_fullgraph_inference(name):
    # Inference is where the bias needs no gradient: a branch on its values there (is it all
    # zero?) cannot be traced by torch.compile(fullgraph=True).
    torch._dynamo.reset()
    model = _tiny(name)
    model.set_attn_implementation("flexdma")
    model.eval()
    ids, am = _inputs("cpu")
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=am).logits
        out = torch.compile(model, fullgraph=True)(input_ids=ids, attention_mask=am).logits
    real = am.bool()
    torch.testing.assert_close(out[real], ref[real], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("form", ["position_ids", "flash_kwargs"])
def test_llama_packed_row_equals_documents_one_by_one(form, monkeypatch):
    # A packed row from DataCollatorWithFlattening: position ids that restart (transformers builds
    # the block-diagonal mask) or its FlashAttention kwargs alone (flexdma_attention_varlen).
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL)).double()
    model.set_attn_implementation("flexdma")
    lens = [4, 1, 7]
    docs = [torch.randint(100, (1, n)) for n in lens]
    kw = dict(use_cache=False)
    if form == "position_ids":
        kw["position_ids"] = torch.cat([torch.arange(n) for n in lens])[None]
    else:
        cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
        kw.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(lens), max_length_k=max(lens))
        kw["position_ids"] = torch.cat([torch.arange(n) for n in lens])[None]  # the rotary positions
    calls = []
    packed_attention = fx._packed_attention
    monkeypatch.setattr(fx, "_packed_attention", lambda *a: calls.append(1) or packed_attention(*a))
    packed = model(input_ids=torch.cat(docs, 1), **kw).logits
    assert len(calls) == (2 if form == "flash_kwargs" else 0)  # one call a layer
    one_by_one = torch.cat([model(input_ids=d, use_cache=False).logits for d in docs], 1)
    torch.testing.assert_close(packed, one_by_one, atol=1e-10, rtol=1e-8)


def test_attention_function_rejects_what_it_does_not_understand():
    # An attention sink (gpt-oss's s_aux) or any new option with a value is an error, never dropped.
    q = torch.randn(1, 2, 5, 8)
    module = torch.nn.Module()
    with pytest.raises(TypeError, match="s_aux"):
        fx.flexdma_attention_forward(module, q, q, q, None, s_aux=torch.zeros(2))
    out, _ = fx.flexdma_attention_forward(module, q, q, q, None, position_ids=torch.arange(5)[None], use_cache=False)
    assert out.shape == (1, 5, 2, 8)
