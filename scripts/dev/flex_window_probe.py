"""Why the perkey bench's FlexAttention peers run ~15x slower at head dim 64 than at 128 (H200: the
window peer's 32K forward 3.1 ms against 0.21): each variant in a fresh process (one compile each,
nothing cached from another shape), do_bench medians in ms.

Variants: the window peer's forward at FlexAttention's defaults and at fixed tile / warp / stage
choices; without the bias's score_mod; with q, k, v contiguous in FlexAttention's (B, H, L, D)
layout; at head dim 128; a D = 64 call after a D = 128 one in the same process (the bench's
order); the training call (forward + backward) at the forward's tiles; flexdma's own FlexAttention
path (backend="flex", the per-key selection) at its options and at the forward's tiles; the
B=2 L=8K H=16 KVH=4 shape.

python -m scripts.dev.flex_window_probe [L] [OUT.json] [VARIANT,...]   (default L = 32768, every variant)
python -m scripts.dev.flex_window_probe --one VARIANT L                (one variant; prints its JSON line)
"""

from __future__ import annotations

import json
import subprocess
import sys

from flexdma.dense import flex

# FlexAttention's forward tiles on sm_90 at head dim 64, 16-bit: 128 x 128 with four warps.
TILE_128x64 = {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}
TRAIN_128x64 = {f"fwd_{k}": v for k, v in TILE_128x64.items()}
# flex.SMALL_BLOCKS' backward tiles, their one stage the backward's alone.
SMALL_BWD = dict({k: v for k, v in flex.SMALL_BLOCKS.items() if k != "num_stages"}, bwd_num_stages=1)
B2L8K = dict(B=2, H=16, KVH=4, bias_heads=4, L=8192)

VARIANTS = {
    "d64 defaults": dict(D=64, opts=None),
    "d64 one_stage": dict(D=64, opts=flex.ONE_STAGE),
    "d64 m128 n64 w4 s3": dict(D=64, opts={"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}),
    "d64 m128 n128 w8 s2": dict(D=64, opts={"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 2}),
    "d64 m64 n64 w4 s2": dict(D=64, opts={"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2}),
    "d64 no score_mod": dict(D=64, opts=None, bias=False),
    "d64 contiguous": dict(D=64, opts=None, contiguous=True),
    "d128 defaults": dict(D=128, opts=None),
    "d64 after d128": dict(D=64, opts=None, after=128),
    "d64 train defaults": dict(D=64, opts=None, train=True),
    "d64 train fwd 128x64": dict(D=64, opts=TRAIN_128x64, train=True),
    "d64 train fwd 128x64 small bwd": dict(D=64, opts=dict(TRAIN_128x64, **SMALL_BWD), train=True),
    "flex d64 options": dict(D=64, flex=None),
    "flex d64 fwd 128x64": dict(D=64, flex=(TILE_128x64, TRAIN_128x64)),
    "flex d64 train options": dict(D=64, flex=None, train=True),
    "flex d64 train fwd 128x64": dict(D=64, flex=(TILE_128x64, TRAIN_128x64), train=True),
    "b2l8k d64 fwd 128x64": dict(D=64, opts=TILE_128x64, shape=B2L8K),
    "b2l8k d64 train fwd 128x64": dict(D=64, opts=TRAIN_128x64, shape=B2L8K, train=True),
}


def one(name: str, L: int) -> dict:
    import torch
    from torch.nn.attention.flex_attention import create_block_mask

    import flexdma
    from benchmarks import perkey
    from benchmarks.peers import compiled_flex
    from flexdma import _device

    spec = VARIANTS[name]
    train = spec.get("train", False)

    def window_variant(c, q, k, v, bias):
        # The window peer's call without the score_mod or with contiguous (B, H, L, D) tensors.
        W, off = c["W"], 0

        def mask_mod(b, h, qi, ki):
            return (ki <= qi + off) & (ki > qi + off - W)

        def score_mod(s, b, h, qi, ki):
            return s + bias[0, 0, 0, ki]

        bm = create_block_mask(mask_mod, None, None, c["Q"], c["L"], device=q.device, BLOCK_SIZE=128)
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        if spec.get("contiguous"):
            qt, kt, vt = (t.contiguous() for t in (qt, kt, vt))
        attend = compiled_flex()
        mod = score_mod if spec.get("bias", True) else None
        return lambda: attend(qt, kt, vt, score_mod=mod, block_mask=bm, enable_gqa=True, kernel_options=spec["opts"])

    def call(D):
        c = dict(name=name, B=1, L=L, Q=L, H=2, KVH=1, D=D, W=2048, bias_heads=1)
        c.update(spec.get("shape", {}))
        c["Q"] = c["L"]
        q, k, v, bias = perkey._inputs(c, grad=train)
        if "flex" in spec:
            cap = _device.device_capability(q.device)
            if spec["flex"] is not None:
                for training, opts in zip((False, True), spec["flex"]):
                    flex.MEASURED_OPTIONS[(cap, D, q.dtype.itemsize, training)] = opts
            fn = lambda: flexdma.flash_dma_attention(  # noqa: E731
                q, k, v, None, bias, is_causal=True, keep_window_size=c["W"], backend="flex"
            )
        elif spec.get("bias", True) and not spec.get("contiguous"):
            fn = perkey._flex_window(c, q, k, v, bias, spec["opts"])
        else:
            fn = window_variant(c, q, k, v, bias)
        if not train:
            return fn

        def step():
            out = fn()
            return torch.autograd.grad(out, (q, k, v, bias), torch.ones_like(out))

        return step

    res = {"variant": name, "L": spec.get("shape", {}).get("L", L)}
    with torch.set_grad_enabled(train):
        if spec.get("after"):
            fn = call(spec["after"])
            fn()
            res[f"d{spec['after']} first ms"] = perkey._time(fn)
        fn = call(spec["D"])
        fn()
        res["train_ms" if train else "fwd_ms"] = perkey._time(fn)
    return res


def main() -> None:
    if sys.argv[1:2] == ["--one"]:
        print("RESULT " + json.dumps(one(sys.argv[2], int(sys.argv[3]))), flush=True)
        return
    L = int(sys.argv[1]) if len(sys.argv) > 1 else 32768
    names = sys.argv[3].split(",") if len(sys.argv) > 3 else list(VARIANTS)
    results = []
    for name in names:
        p = subprocess.run(
            [sys.executable, "-m", "scripts.dev.flex_window_probe", "--one", name, str(L)],
            capture_output=True,
            text=True,
            timeout=240,
        )
        lines = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
        r = json.loads(lines[-1][7:]) if lines else {"variant": name, "error": (p.stderr or p.stdout)[-400:]}
        print(json.dumps(r), flush=True)
        results.append(r)
    if len(sys.argv) > 2:
        with open(sys.argv[2], "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
