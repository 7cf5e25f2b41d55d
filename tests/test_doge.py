"""flexdma.integrations.transformers.patch_doge: a transformers DogeForCausalLM runs its dynamic mask
attention through flash_dma_attention(keep_window_size=...) and matches the eager model (which builds
the (B, H, Q, K) dynamic mask), in logits, gradients and greedy generation, without a Q x K tensor."""

import copy
import inspect

import pytest
import torch
from torch._dynamo.utils import counters
from utils import LargestTensor

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DogeForCausalLM"):
    pytest.skip("this transformers has no Doge model", allow_module_level=True)

import flexdma.integrations.transformers as fx  # noqa: E402

VOCAB, W = 64, 5


def _models(dtype, layers=2, hidden=32, window=W):
    cfg = transformers.DogeConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        keep_window_size=window,
        is_moe=False,
        max_position_embeddings=512,
    )
    eager = transformers.DogeForCausalLM(cfg).to(dtype)
    eager.set_attn_implementation("eager")
    with torch.no_grad():
        # A = 0 (the init) scores every key 1: all ties, which Doge's unsorted topk breaks its own way.
        for layer in eager.model.layers:
            layer.self_attn.A.normal_()
    return eager, fx.patch_doge(copy.deepcopy(eager))


def _cache_kw(cache):
    # The model's cache argument: `cache` from transformers 5.24 on (`past_key_values` deprecated
    # there), `past_key_values` before.
    name = (
        "cache" if "cache" in inspect.signature(transformers.DogeForCausalLM.forward).parameters else "past_key_values"
    )
    return {name: cache}


def _ids(B, S):
    # Distinct tokens: the first layer's scores depend on the token only (v has no position), so a
    # repeated token would tie with itself, and Doge's topk breaks ties differently from flexdma.
    return torch.stack([torch.randperm(VOCAB)[:S] for _ in range(B)])


def _run(model, ids, am):
    model.zero_grad()
    labels = ids.clone()
    if am is not None:
        # Logits at padded positions (and the one predicting the first real token) are excluded:
        # eager attends uniformly there, flexdma gives 0.
        labels[:, 1:][am[:, :-1] == 0] = -100
        labels[am == 0] = -100
    out = model(input_ids=ids, attention_mask=am, labels=labels)
    out.loss.backward()
    return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("padded", [False, True])
def test_logits_and_grads_match_eager(padded):
    # float64 without padding. With left padding eager Doge is NaN in float64 (its softmax runs in
    # float32, where a fully masked padded row's float64 min becomes -inf), so that case is float32.
    dtype = torch.float32 if padded else torch.float64
    eager, patched = _models(dtype)
    ids = _ids(2, 20)  # longer than keep_window_size: the selection drops keys
    am = None
    if padded:
        am = torch.ones(2, 20, dtype=torch.long)
        am[1, :6] = 0
    le, ge = _run(eager, ids, am)
    lp, gp = _run(patched, ids, am)
    real = torch.ones(2, 20, dtype=torch.bool) if am is None else am.bool()
    tol = dict(atol=1e-6, rtol=1e-5) if dtype == torch.float64 else dict(atol=2e-5, rtol=1e-4)
    # Eager's softmax is float32 even for a float64 model: that sets the float64 tolerance.
    torch.testing.assert_close(lp[real], le[real], **tol)
    assert ge.keys() == gp.keys() and any("dt_proj" in n for n in ge) and any(n.endswith(".A") for n in ge)
    for n in ge:
        torch.testing.assert_close(gp[n], ge[n], **tol, msg=lambda m: f"{n}: {m}")


def test_greedy_generate_matches_eager():
    eager, patched = _models(torch.float32, layers=3)
    # Generated tokens repeat, and a repeated token ties with itself in the first layer: there the
    # window covers every key (both models read the module attribute), the later layers select.
    for m in (eager, patched):
        m.model.layers[0].self_attn.keep_window_size = 10_000
    ids = _ids(2, 8)
    am = torch.ones(2, 8, dtype=torch.long)
    am[1, :3] = 0
    seqs = [
        m.generate(ids, attention_mask=am, max_new_tokens=10, do_sample=False, pad_token_id=0) for m in (eager, patched)
    ]
    assert seqs[0].shape == (2, 18)
    assert torch.equal(seqs[1], seqs[0])


def test_no_q_by_k_tensor():
    _, patched = _models(torch.float32)
    S = 256  # Q * K = 65536 is above every activation (S x vocab = 16384, S x intermediate = 16384)
    ids = torch.randint(VOCAB, (1, S))
    am = torch.ones(1, S, dtype=torch.long)
    am[0, :7] = 0
    with LargestTensor() as mode:
        out = patched(input_ids=ids, attention_mask=am, labels=ids)
        out.loss.backward()
    assert torch.isfinite(out.loss)
    assert mode.largest < S * S, mode.largest


def test_patch_doge_rejects():
    cfg = transformers.DogeConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        keep_window_size=W,
        sliding_window=8,
    )
    with pytest.raises(ValueError, match="sliding window"):
        fx.patch_doge(transformers.DogeForCausalLM(cfg))
    with pytest.raises(ValueError, match="no DogeAttention"):
        fx.patch_doge(
            transformers.LlamaForCausalLM(
                transformers.LlamaConfig(
                    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4
                )
            )
        )


def test_trainer_kwargs_pass_through():
    # transformers' Trainer hands the model num_items_in_batch (its loss normaliser), which Doge
    # passes down to every attention layer with the other TransformersKwargs.
    eager, patched = _models(torch.float64)
    ids = _ids(2, 12)
    n = torch.tensor(22)
    le = eager(input_ids=ids, labels=ids, num_items_in_batch=n).loss
    lp = patched(input_ids=ids, labels=ids, num_items_in_batch=n, is_causal=True).loss
    torch.testing.assert_close(lp, le, atol=1e-6, rtol=1e-5)


def test_one_token_prompt_generates_as_eager():
    # A prompt of one token (a BOS alone): the first step's bias has one key.
    eager, patched = _models(torch.float32, layers=3)
    for m in (eager, patched):
        m.model.layers[0].self_attn.keep_window_size = 10_000  # generated tokens repeat (see above)
    ids = _ids(2, 1)
    seqs = [m.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0) for m in (eager, patched)]
    assert seqs[0].shape == (2, 9)
    assert torch.equal(seqs[1], seqs[0])


@pytest.mark.parametrize("name", ["past_key_values", "cache"])
def test_patched_layer_reads_the_cache_under_either_name(name):
    # transformers <= 5.23 hands the layer its cache as past_key_values, 5.24 on as cache: a step
    # against a filled cache equals the last row of the full sequence, whichever name carries it.
    _, patched = _models(torch.float64, layers=1)
    layer, rotary = patched.model.layers[0].self_attn, patched.model.rotary_emb
    S = 9  # above keep_window_size: the step selects among the cached keys
    hidden = torch.randn(1, S, 32, dtype=torch.float64)
    cos, sin = rotary(hidden, torch.arange(S)[None])
    full, _ = layer(hidden, (cos, sin), None)
    cache = transformers.DynamicCache()
    layer(hidden[:, :-1], (cos[:, :-1], sin[:, :-1]), None, **{name: cache})
    step, _ = layer(hidden[:, -1:], (cos[:, -1:], sin[:, -1:]), None, **{name: cache})
    assert cache.get_seq_length() == S
    torch.testing.assert_close(step, full[:, -1:], atol=1e-10, rtol=1e-10)


def test_patched_layer_rejects_what_it_does_not_understand():
    _, patched = _models(torch.float32, layers=1)
    layer, rotary = patched.model.layers[0].self_attn, patched.model.rotary_emb
    hidden = torch.randn(1, 4, 32)
    pe = rotary(hidden, torch.arange(4)[None])
    with pytest.raises(TypeError, match="new_flag"):
        layer(hidden, pe, None, new_flag=True)
    with pytest.raises(ValueError, match="causal"):
        layer(hidden, pe, None, is_causal=False)
    cu = torch.tensor([0, 2, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="packed sequences"):
        layer(hidden, pe, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu)
    with pytest.raises(ValueError, match="two different caches"):
        layer(hidden, pe, None, past_key_values=transformers.DynamicCache(), cache=transformers.DynamicCache())


def test_patch_doge_checks_the_forward_it_replaces(monkeypatch):
    from transformers.models.doge.modeling_doge import DogeAttention

    def forward(self, hidden_states, position_embeddings, attention_mask=None, cache=None, new_arg=None, **kwargs):
        raise AssertionError("never called")

    eager, _ = _models(torch.float32, layers=1)
    monkeypatch.setattr(DogeAttention, "forward", forward)
    with pytest.raises(TypeError, match="unknown: \\('new_arg',\\)"):
        fx.patch_doge(eager)


def _count_decode_steps(monkeypatch):
    calls = []
    step = fx._doge_decode_step

    def counted(*args, **kwargs):
        calls.append(1)
        return step(*args, **kwargs)

    monkeypatch.setattr(fx, "_doge_decode_step", counted)
    return calls


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("per_step", [1, 3])
@torch.no_grad()
def test_decode_steps_match_the_full_forward(monkeypatch, padded, per_step):
    # Token by token against a cache (without autograd, as in generate), each step keeps the
    # newest row's kept set up to date in O(W) (no selection over the cached keys): the same kept
    # set and output as the full sequence's row.
    calls = _count_decode_steps(monkeypatch)
    _, patched = _models(torch.float64, layers=1)
    layer, rotary = patched.model.layers[0].self_attn, patched.model.rotary_emb
    S0, S = 4, 16  # the prompt is shorter than W = 5: free slots first, then replacements
    hidden = torch.randn(2, S, 32, dtype=torch.float64)
    cos, sin = rotary(hidden, torch.arange(S)[None])
    am = torch.ones(2, S, dtype=torch.bool)
    if padded:
        am[1, :2] = False  # left padding
    full, _ = layer(hidden, (cos, sin), am if padded else None)
    cache = transformers.DynamicCache()
    layer(hidden[:, :S0], (cos[:, :S0], sin[:, :S0]), am[:, :S0] if padded else None, past_key_values=cache)
    v_all = layer.v_proj(hidden).view(2, S, 2, 8).transpose(1, 2)
    scores = fx._doge_scores(layer, v_all)  # (B, KVH, S)
    for i0 in range(S0, S, per_step):
        # per_step > 1: a few tokens a step (speculative decoding), each row with its own kept set;
        # the kept set checked is the newest row's.
        i = min(i0 + per_step, S) - 1
        sl = slice(i0, i + 1)
        step, _ = layer(
            hidden[:, sl], (cos[:, sl], sin[:, sl]), am[:, : i + 1] if padded else None, past_key_values=cache
        )
        torch.testing.assert_close(step, full[:, sl], atol=1e-10, rtol=1e-10)
        kept = fx._kept_state(cache, layer).kept
        got = torch.zeros(2, 2, i + 1, dtype=torch.int64).scatter_add_(-1, kept.idx, kept.valid.long())
        want = torch.zeros(2, 2, i + 1, dtype=torch.int64)
        s = scores[..., : i + 1].masked_fill(~am[:, None, : i + 1], float("-inf"))
        top = torch.sort(s, dim=-1, descending=True, stable=True).indices[..., :W]
        want.scatter_(-1, top, (s.gather(-1, top) > float("-inf")).long())
        assert torch.equal(got, want), i
    assert len(calls) == -(-(S - S0) // per_step)


@torch.no_grad()
def test_cuda_one_kernel_decode_steps(monkeypatch):
    # On CUDA a one-token step is one kernel (flexdma.perkey.decode.attend_one): the same kept sets
    # as the gathered path's O(W) updates, and outputs within FlashAttention's rule of the float64
    # full sequence (at most 2x the gathered bf16 path's error plus a floor). Head dim 16.
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    pytest.importorskip("triton")
    from flexdma.perkey import decode

    _, patched = _models(torch.bfloat16, layers=1, hidden=64)
    layer, rotary = patched.model.layers[0].self_attn.cuda(), patched.model.rotary_emb.cuda()
    wide = copy.deepcopy(layer).double()
    wide._flexdma_backend = "reference"
    S0, S = 3, 40
    hidden = torch.randn(2, S, 64, device="cuda").bfloat16()
    cos, sin = rotary(hidden.double(), torch.arange(S, device="cuda")[None])
    am = torch.ones(2, S, dtype=torch.bool, device="cuda")
    am[1, :2] = False  # left padding
    full, _ = wide(hidden.double(), (cos, sin), am)
    one_kernel = []
    attend_one = decode.attend_one
    monkeypatch.setattr(decode, "attend_one", lambda *a, **k: one_kernel.append(1) or attend_one(*a, **k))
    runs = {}
    for path in ("one kernel", "gathered"):
        if path == "gathered":
            monkeypatch.setattr(decode, "one_kernel_reason", lambda *a: "forced")
        cache = transformers.DynamicCache()
        c, s = cos[:, :S0].bfloat16(), sin[:, :S0].bfloat16()
        layer(hidden[:, :S0], (c, s), am[:, :S0], past_key_values=cache)
        steps, kept = [], []
        for i in range(S0, S):
            c, s = cos[:, i : i + 1].bfloat16(), sin[:, i : i + 1].bfloat16()
            step, _ = layer(hidden[:, i : i + 1], (c, s), am[:, : i + 1], past_key_values=cache)
            steps.append(step.double())
            k = fx._kept_state(cache, layer).kept
            kept.append(
                torch.zeros(2, 2, i + 1, dtype=torch.int64, device="cuda").scatter_add_(-1, k.idx, k.valid.long())
            )
        runs[path] = (torch.cat(steps, 1), kept)
    assert len(one_kernel) == S - S0
    for a, b in zip(runs["one kernel"][1], runs["gathered"][1]):
        assert torch.equal(a, b)
    want = full[:, S0:]
    err = (runs["one kernel"][0] - want).abs().max().item()
    base = (runs["gathered"][0] - want).abs().max().item()
    assert err <= 2 * base + 1e-2, (err, base)


def test_generate_decodes_in_o_w(monkeypatch):
    # generate's decode steps take the kept-set path in every layer (greedy, left padding, B = 2).
    calls = _count_decode_steps(monkeypatch)
    eager, patched = _models(torch.float32, layers=2)
    for m in (eager, patched):
        m.model.layers[0].self_attn.keep_window_size = 10_000  # generated tokens repeat (see above)
    ids = _ids(2, 7)
    am = torch.ones(2, 7, dtype=torch.long)
    am[0, :2] = 0
    seqs = [
        m.generate(ids, attention_mask=am, max_new_tokens=6, do_sample=False, pad_token_id=0) for m in (eager, patched)
    ]
    assert torch.equal(seqs[1], seqs[0])
    assert len(calls) == 2 * 5  # 2 layers x the 5 steps after the prompt's


def test_beam_search_reorders_the_kept_sets():
    eager, patched = _models(torch.float32, layers=2)
    for m in (eager, patched):
        m.model.layers[0].self_attn.keep_window_size = 10_000
    ids = _ids(1, 7)
    kw = dict(max_new_tokens=6, num_beams=3, do_sample=False, pad_token_id=0, early_stopping=False)
    seqs = [m.generate(ids, **kw) for m in (eager, patched)]
    assert torch.equal(seqs[1], seqs[0])


@torch.no_grad()
def test_cache_hooks_follow_copies_and_batch_changes():
    # The kept sets follow the cache's batch methods, on the cache itself and on a deep copy of it.
    _, patched = _models(torch.float32, layers=1)
    cache = transformers.DynamicCache()
    patched(input_ids=_ids(2, 6), **_cache_kw(cache), use_cache=True)
    layer = patched.model.layers[0].self_attn
    before = fx._kept_state(cache, layer).kept.idx.clone()
    twin = copy.deepcopy(cache)
    twin.reorder_cache(torch.tensor([1, 0]))
    assert torch.equal(fx._kept_state(twin, layer).kept.idx, before.flip(0))
    assert torch.equal(fx._kept_state(cache, layer).kept.idx, before)  # the original is untouched
    cache.batch_select_indices([1])
    assert torch.equal(fx._kept_state(cache, layer).kept.idx, before[1:])
    cache.crop(-2)  # (transformers 5 takes the tokens to remove; 4.56 a length: either drops keys)
    assert fx._kept_state(cache, layer) is None  # the next step selects over the cache again


@pytest.mark.parametrize("padded", [False, True])
def test_static_cache_generates_as_eager(monkeypatch, padded):
    # cache_implementation="static": the cache returns its capacity; the prompt runs on the written
    # keys, and every later token goes through the kept sets with its position a device tensor.
    # The same tokens as eager Doge with a static cache and as the patched model with DynamicCache.
    calls = _count_decode_steps(monkeypatch)
    eager, patched = _models(torch.float32, layers=2)
    ids = _ids(2, 7)
    am = torch.ones(2, 7, dtype=torch.long)
    if padded:
        am[0, :2] = 0
    kw = dict(attention_mask=am, max_new_tokens=8, do_sample=False, pad_token_id=0)
    want = eager.generate(ids, cache_implementation="static", **kw)
    assert torch.equal(patched.generate(ids, cache_implementation="static", **kw), want)
    assert len(calls) == 2 * 7  # 2 layers x the 7 tokens after the prompt's
    assert torch.equal(patched.generate(ids, **kw), want)


def test_static_cache_beam_search():
    # Beam search reorders a static cache's rows; the kept sets follow (the cache hooks).
    eager, patched = _models(torch.float32, layers=2)
    ids = _ids(2, 7)
    am = torch.ones(2, 7, dtype=torch.long)
    am[0, :2] = 0
    kw = dict(attention_mask=am, max_new_tokens=6, num_beams=3, do_sample=False, pad_token_id=0)
    kw["cache_implementation"] = "static"
    assert torch.equal(patched.generate(ids, **kw), eager.generate(ids, **kw))


@torch.no_grad()
def test_static_cache_steps_of_a_few_tokens(monkeypatch):
    # Steps of 3 tokens and of 1 against a static cache (the new keys' positions a device tensor)
    # equal the same steps against DynamicCache, through the kept sets each time.
    calls = _count_decode_steps(monkeypatch)
    _, patched = _models(torch.float32, layers=2)
    ids = _ids(2, 12)
    am = torch.ones(2, 12, dtype=torch.long)
    am[0, :2] = 0
    outs = []
    for cache in (transformers.StaticCache(config=patched.config, max_cache_len=16), transformers.DynamicCache()):
        logits = []
        for a, b in ((0, 5), (5, 8), (8, 9), (9, 12)):
            pos = torch.arange(a, b)[None].expand(2, -1)
            logits.append(patched(input_ids=ids[:, a:b], attention_mask=am[:, :b], **_cache_kw(cache),
                                  position_ids=pos, cache_position=torch.arange(a, b), use_cache=True).logits)  # fmt: skip
        outs.append(torch.cat(logits, 1))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
    assert len(calls) == 2 * 2 * 3  # both caches, 2 layers, the 3 steps after the prompt


def test_static_cache_one_token_prompt():
    eager, patched = _models(torch.float32, layers=2)
    ids = _ids(1, 1)
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, cache_implementation="static")
    assert torch.equal(patched.generate(ids, **kw), eager.generate(ids, **kw))


def test_static_cache_compiled_generation(monkeypatch):
    # transformers' compiled generation (a static cache, the forward under torch.compile with
    # fullgraph=True; forced on the CPU, with the aot_eager backend): no graph break in the patched
    # layers, the same tokens as uncompiled generation. The compiled steps keep each layer's kept
    # set in the prefill's buffers (what a step returns is a CUDA graph's memory, overwritten by its
    # next replay on a GPU).
    cc = pytest.importorskip("transformers").CompileConfig(fullgraph=True, backend="aot_eager")
    if not hasattr(cc, "_compile_all_devices"):
        pytest.skip("this transformers compiles generation on accelerators only")
    cc._compile_all_devices = True
    _, patched = _models(torch.float32, layers=2)
    ids = _ids(2, 7)
    am = torch.ones(2, 7, dtype=torch.long)
    am[0, :2] = 0
    kw = dict(attention_mask=am, max_new_tokens=6, do_sample=False, pad_token_id=0)
    want = patched.generate(ids, **kw)
    kept = {}
    set_state = fx._set_kept_state

    def recorded(cache, layer, state):
        kept.setdefault(layer.layer_idx, []).append(state.kept)
        set_state(cache, layer, state)

    torch._dynamo.reset()
    counters.clear()
    assert torch.equal(patched.generate(ids, cache_implementation="static", compile_config=cc, **kw), want)
    # Every decode step through one traced graph: a shape that changed from token to token (a mask
    # as wide as the tokens so far) would retrace step after step, and on CUDA record a graph each.
    assert counters["stats"]["unique_graphs"] == 1
    monkeypatch.setattr(fx, "_set_kept_state", recorded)  # (its growing lists retrace each step)
    assert torch.equal(patched.generate(ids, cache_implementation="static", compile_config=cc, **kw), want)
    assert sorted(kept) == [0, 1] and all(len(sets) == 6 for sets in kept.values())
    for sets in kept.values():
        assert all(t is t0 for later in sets[1:] for t, t0 in zip(later, sets[0])), "kept set moved to new buffers"


def test_cuda_static_cache_compiled_generation():
    # On CUDA transformers compiles generation with a static cache (Inductor, CUDA graphs): the
    # patched layers' steps (traced: the kept set's torch ops, updated in place in the prefill's
    # buffers) replay in the graph. Against uncompiled generation with DynamicCache, in float32:
    # the same tokens and scores. (In bf16 Inductor's fused ops round otherwise than eager ones,
    # and a tiny random model's near-tied logits then pick other tokens after a few steps.)
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    pytest.importorskip("triton")
    _, patched = _models(torch.float32, layers=2, hidden=64)
    patched = patched.cuda()
    ids = _ids(2, 7).cuda()
    am = torch.ones(2, 7, dtype=torch.long, device="cuda")
    am[0, :2] = 0
    kw = dict(attention_mask=am, max_new_tokens=6, do_sample=False, pad_token_id=0)
    kw.update(return_dict_in_generate=True, output_scores=True)
    want = patched.generate(ids, **kw)
    got = patched.generate(ids, cache_implementation="static", **kw)
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.scores, want.scores):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    # The model compiled whole (its prompt and steps traced, Inductor), DynamicCache: the same tokens.
    compiled = copy.deepcopy(patched)
    compiled.compile(fullgraph=True)
    torch._dynamo.reset()
    assert torch.equal(compiled.generate(ids, **kw).sequences, want.sequences)


@torch.no_grad()
def test_static_cache_rejects_a_changed_mask():
    _, patched = _models(torch.float32, layers=1)
    ids = _ids(2, 6)
    am = torch.ones(2, 7, dtype=torch.long)
    am[1, :2] = 0
    cache = transformers.StaticCache(config=patched.config, max_cache_len=16)
    patched(input_ids=ids, attention_mask=am[:, :6], **_cache_kw(cache), use_cache=True)
    am[1, :2] = 1
    with pytest.raises(ValueError, match="earlier columns changed"):
        patched(input_ids=ids[:, :1], attention_mask=am, **_cache_kw(cache), use_cache=True)


@torch.no_grad()
def test_decode_rejects_a_cache_of_another_model_and_a_changed_mask():
    _, patched = _models(torch.float32, layers=1)
    _, other = _models(torch.float32, layers=1)
    ids = _ids(1, 6)
    cache = transformers.DynamicCache()
    patched(input_ids=ids, **_cache_kw(cache), use_cache=True)
    with pytest.raises(ValueError, match="another model"):
        other(input_ids=ids[:, :1], **_cache_kw(cache), use_cache=True)
    am = torch.ones(2, 7, dtype=torch.long)
    am[1, :2] = 0
    ids = _ids(2, 6)
    cache = transformers.DynamicCache()
    patched(input_ids=ids, attention_mask=am[:, :6], **_cache_kw(cache), use_cache=True)
    am[1, :2] = 1  # the padding the kept sets were selected under, changed
    with pytest.raises(ValueError, match="earlier columns changed"):
        patched(input_ids=ids[:, :1], attention_mask=am, **_cache_kw(cache), use_cache=True)


@pytest.mark.parametrize("form", ["position_ids", "flash_kwargs"])
def test_packed_batch_equals_documents_one_by_one(form):
    # DataCollatorWithFlattening's packed row (position ids that restart, or its FlashAttention
    # kwargs): logits and gradients equal the documents run one by one (lengths below and above
    # W = 5, one of a single token).
    _, patched = _models(torch.float64, layers=2)
    lens = [5, 1, 9, 3]
    docs = [_ids(1, n) for n in lens]
    kw = dict(position_ids=torch.cat([torch.arange(n) for n in lens])[None], use_cache=False)
    if form == "flash_kwargs":
        cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
        kw.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(lens), max_length_k=max(lens))
    weights = torch.randn(1, sum(lens), VOCAB, dtype=torch.float64)
    packed = patched(input_ids=torch.cat(docs, 1), **kw).logits
    (packed * weights).sum().backward()
    grads = {n: p.grad.clone() for n, p in patched.named_parameters() if p.grad is not None}
    patched.zero_grad()
    one_by_one, start = [], 0
    for d in docs:
        logits = patched(input_ids=d, use_cache=False).logits
        (logits * weights[:, start : start + d.shape[1]]).sum().backward()
        one_by_one.append(logits.detach())
        start += d.shape[1]
    torch.testing.assert_close(packed.detach(), torch.cat(one_by_one, 1), atol=1e-10, rtol=1e-8)
    assert {n for n, p in patched.named_parameters() if p.grad is not None} == set(grads)
    for n, p in patched.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(grads[n], p.grad, atol=1e-9, rtol=1e-7, msg=n)


def test_packed_batch_rejections():
    _, patched = _models(torch.float32, layers=1)
    ids = _ids(2, 6)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match="one row"):
        patched(input_ids=ids, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=4, max_length_k=4, use_cache=False)
    with pytest.raises(ValueError, match="need all of"):
        patched(input_ids=ids[:1], cu_seq_lens_q=cu, use_cache=False)
    with pytest.raises(ValueError, match="seq_idx"):
        patched(input_ids=ids, seq_idx=torch.zeros(2, 6, dtype=torch.int32), use_cache=False)


# ----------------------------------------------------------------------------------------------
# torch.compile(model, fullgraph=True) of a patched model, called as users call it. aot_eager (the
# traced forward and backward graphs run by eager kernels) where Inductor's compile time would make
# the test slow; the Trainer test compiles with the default backend, Inductor.


def _output_cache(out):
    # The cache the model returns: `cache` from transformers 5.24 on, `past_key_values` before.
    return next(out[k] for k in ("cache", "past_key_values") if k in out)


def _call_kwargs(form: str, mask: bool, use_cache):
    """A batch of one sequence, a left-padded batch, or rows of sequences packed by position ids
    that restart (one of a single token); with or without the attention mask, with use_cache left
    at its default or False."""
    B = 1 if form == "one" else 2
    kw = dict(input_ids=_ids(B, 12))
    am = torch.ones(B, 12, dtype=torch.long)
    if form == "padded":
        am[1, :4] = 0
    if form == "packed":
        kw["position_ids"] = torch.stack([torch.cat([torch.arange(n) for n in lens]) for lens in ([5, 7], [3, 1, 8])])
    if mask:
        kw["attention_mask"] = am
    if use_cache is False:
        kw["use_cache"] = False
    return kw


@pytest.mark.parametrize("use_cache", ["default", False], ids=["use_cache_default", "no_cache"])
@pytest.mark.parametrize("mask", [True, False], ids=["mask", "no_mask"])
@pytest.mark.parametrize("form", ["one", "padded", "packed"])
def test_compiled_train_steps_match_eager(form, mask, use_cache):
    # Two train steps (forward, backward, AdamW step) of the compiled model and of the eager one:
    # the same logits, gradients and kept sets (with a cache), one graph for both steps. Traced, a
    # call without attention_mask runs through the packed path whatever its position ids (nothing
    # is read on the host): the same numbers as the eager model's padded call.
    _, eager = _models(torch.float64, layers=1)
    model = copy.deepcopy(eager)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    kw = _call_kwargs(form, mask, use_cache)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (eager, model)]
    torch._dynamo.reset()
    counters.clear()
    for _ in range(2):
        runs = []
        for m, call, opt in ((eager, eager, opts[0]), (model, compiled, opts[1])):
            out = call(**kw, labels=kw["input_ids"])
            out.loss.backward()
            grads = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
            cache = _output_cache(out) if use_cache == "default" else None
            kept = None if cache is None else fx._kept_state(cache, m.model.layers[0].self_attn).kept
            runs.append((out.logits.detach(), grads, kept))
            opt.step()
            opt.zero_grad()
        (le, ge, ke), (lc, gc, kc) = runs
        torch.testing.assert_close(lc, le, atol=1e-12, rtol=1e-10)
        assert ge.keys() == gc.keys() and any("dt_proj" in n for n in ge) and any(n.endswith(".A") for n in ge)
        for n in ge:
            torch.testing.assert_close(gc[n], ge[n], atol=1e-12, rtol=1e-10, msg=lambda m: f"{n}: {m}")
        assert (kc is None) == (use_cache != "default")
        if kc is not None:
            assert torch.equal(kc.idx, ke.idx) and torch.equal(kc.valid, ke.valid)
            torch.testing.assert_close(kc.score, ke.score, atol=1e-12, rtol=1e-10)
    assert counters["stats"]["unique_graphs"] == 1


@pytest.mark.parametrize("cache_implementation", ["dynamic", "static"])
def test_compiled_generate_matches_eager(cache_implementation):
    # generate of the compiled model (its prompt and its decode steps traced; a static cache's
    # prompt on the window of the capacity that ends at its last key): the eager model's tokens.
    _, patched = _models(torch.float32, layers=2)
    ids = _ids(2, 7)
    am = torch.ones(2, 7, dtype=torch.long)
    am[0, :2] = 0
    kw = dict(attention_mask=am, max_new_tokens=5, do_sample=False, pad_token_id=0)
    if cache_implementation == "static":
        kw["cache_implementation"] = "static"
    want = patched.generate(ids, **kw)
    compiled = copy.deepcopy(patched)
    compiled.compile(fullgraph=True, backend="aot_eager")
    torch._dynamo.reset()
    assert torch.equal(compiled.generate(ids, **kw), want)


def test_trainer_trains_the_compiled_model(tmp_path):
    # transformers.Trainer on the model compiled whole with the default backend (Inductor), as users
    # train: the eager model's losses and parameters step after step, and the loss goes down (one
    # sequence, no attention_mask, use_cache left at its default).
    pytest.importorskip("accelerate")  # the Trainer needs it
    _, patched = _models(torch.float32, layers=1)
    seq = _ids(1, 12)[0]
    data = [{"input_ids": seq, "labels": seq}] * 8
    runs = []
    for compiled in (False, True):
        model = copy.deepcopy(patched)
        if compiled:
            torch._dynamo.reset()
            model.compile(fullgraph=True)
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / str(compiled)), max_steps=4, per_device_train_batch_size=2, learning_rate=1e-2,
            lr_scheduler_type="constant", logging_steps=1, report_to=[], use_cpu=True, save_strategy="no",
            disable_tqdm=True,
        )  # fmt: skip
        trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
        trainer.train()
        runs.append(([h["loss"] for h in trainer.state.log_history if "loss" in h], model))
    (le, eager), (lc, model) = runs
    assert len(lc) == 4 and lc[-1] < lc[0], lc
    assert lc == pytest.approx(le, rel=1e-5)
    for (n, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-4, msg=lambda m: f"{n}: {m}")


def test_mask_interface_takes_transformers_masks_only():
    # The padding-mask builder patch_doge installs takes the masks transformers composes for Doge --
    # causal, and causal within the packed sequences of position ids that restart -- and refuses a
    # custom overlay (it would vary the visible keys by row).
    from transformers.masking_utils import create_causal_mask

    _, patched = _models(torch.float32, layers=1)
    params = inspect.signature(create_causal_mask).parameters
    kw = dict(config=patched.config, attention_mask=None, position_ids=torch.tensor([[0, 1, 2, 0, 1, 2]]))
    kw["inputs_embeds" if "inputs_embeds" in params else "input_embeds"] = torch.randn(1, 6, 32)
    kw["cache" if "cache" in params else "past_key_values"] = None
    if "cache_position" in params:
        kw["cache_position"] = torch.arange(6)
    assert create_causal_mask(**kw) is None  # packed: the layers read the sequences from the position ids
    am = torch.ones(1, 6, dtype=torch.long)
    am[0, 0] = 0
    assert torch.equal(create_causal_mask(**{**kw, "attention_mask": am}), am.bool())
    for overlay in ("or_mask_function", "and_mask_function"):
        with pytest.raises(NotImplementedError, match="custom mask overlays"):
            create_causal_mask(**kw, **{overlay: lambda b, h, q, kv: kv >= 0})


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


@pytest.mark.parametrize("form", ["padded", "packed"])
def test_inductor_train_step_of_two_layers_without_mask(form):
    # Inductor, as users compile: without attention_mask every layer traces the packed call, its
    # offsets from nonzero (a data-dependent size, one per layer, which the partitioner merges), and
    # the selection's lists, saved for the backward, must not name the merged size (Inductor once
    # stopped at "u1 not in {u0: ...}" on the second layer). Logits and gradients as the eager
    # model's.
    _, eager = _models(torch.float32, layers=2, hidden=256, window=16)
    model = copy.deepcopy(eager)
    compiled = torch.compile(model, fullgraph=True)
    kw = _call_kwargs(form, False, "default")
    torch._dynamo.reset()
    runs = []
    for m, call in ((eager, eager), (model, compiled)):
        out = call(**kw, labels=kw["input_ids"])
        out.loss.backward()
        runs.append((out.logits.detach(), {n: p.grad for n, p in m.named_parameters() if p.grad is not None}))
    (le, ge), (lc, gc) = runs
    torch.testing.assert_close(lc, le, atol=1e-5, rtol=1e-4)
    assert ge.keys() == gc.keys()
    for n in ge:
        torch.testing.assert_close(gc[n], ge[n], atol=1e-4, rtol=1e-3, msg=lambda m: f"{n}: {m}")


@pytest.mark.parametrize("mask", [True, False], ids=["mask", "no_mask"])
@pytest.mark.parametrize("form", ["padded", "packed"])
def test_cuda_compiled_train_step(form, mask):
    # On CUDA with Inductor, as users train: a bf16 train step of the compiled model (head_dim 64:
    # the flexdma CUDA ops in the graph; without attention_mask the packed ones) against the eager
    # model's, within bf16's rounding of fused and unfused ops. Every row keeps all its keys (the
    # window covers the 12 tokens): Inductor rounds the fused bias otherwise than eager bf16 ops,
    # and at a near tie one ulp picks another key, a different model. What the compiled selection
    # keeps is checked exactly in float64 (test_compiled_train_steps_match_eager).
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    pytest.importorskip("triton")
    _, eager = _models(torch.float32, layers=2, hidden=256, window=16)
    eager = eager.to("cuda", torch.bfloat16)
    model = copy.deepcopy(eager)
    # The ground truth: the same (bf16-rounded) weights in float64, on the CPU kernels.
    exact = copy.deepcopy(eager).to("cpu", torch.float64)
    compiled = torch.compile(model, fullgraph=True)
    kw = _call_kwargs(form, mask, "default")
    torch._dynamo.reset()
    runs = []
    for m, call, dev in ((exact, exact, "cpu"), (eager, eager, "cuda"), (model, compiled, "cuda")):
        args = {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
        out = call(**args, labels=args["input_ids"])
        out.loss.backward()
        runs.append(
            (out.logits.detach().cpu(), {n: p.grad.cpu() for n, p in m.named_parameters() if p.grad is not None})
        )
    (lx, gx), (le, ge), (lc, gc) = runs
    # FlashAttention's rule: the compiled bf16 model's error against float64 at most twice the
    # eager bf16 model's, plus a floor (a gradient of a few elements summed over every token, as
    # A's, cancels to a few ulps of its terms).
    assert _rel_err(lc, lx) <= 2 * _rel_err(le, lx) + 1e-2
    assert gx.keys() == ge.keys() == gc.keys()
    for n in gx:
        assert _rel_err(gc[n], gx[n]) <= 2 * _rel_err(ge[n], gx[n]) + 2e-2, n
