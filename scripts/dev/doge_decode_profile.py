"""Where a Doge decode token's time goes: transformers' DogeForCausalLM (benchmarks.perkey.DOGE's
config, A drawn in [0.5, 1.5]) generating after a prompt, patched by patch_doge (DynamicCache, or
a static cache under transformers' compiled generation) or eager Doge. torch.profiler over a few
decode tokens: the device operations a token launches, the GPU time they take, the host time a
token takes, and the top operations by host and by device time.

python -m scripts.dev.doge_decode_profile [--L 8192] [--B 1] [--tokens 8] [--peers flexdma,flexdma-static,eager]
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch
from torch.profiler import ProfilerActivity, profile

import flexdma.integrations.transformers as hf
from benchmarks.perkey import DOGE

PEERS = ("flexdma", "flexdma-static", "eager")


def model_for(peer: str, L: int, new: int, device: str, dtype):
    from transformers import DogeConfig, DogeForCausalLM

    torch.manual_seed(0)
    cfg = DogeConfig(max_position_embeddings=L + new + 8, **DOGE)
    model = DogeForCausalLM(cfg).to(device=device, dtype=dtype).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.A.uniform_(0.5, 1.5)  # scores that do not tie
    if peer == "eager":
        model.set_attn_implementation("eager")
    else:
        hf.patch_doge(model)
    return model


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--L", type=int, default=8192)
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--peers", default=",".join(PEERS))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--rows", type=int, default=12, help="operations listed per table")
    a = ap.parse_args()
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if a.device == "cuda" else [])
    for peer in a.peers.split(","):
        if peer not in PEERS:
            raise SystemExit(f"--peers: {peer!r} is not one of {PEERS}")
        model = model_for(peer, a.L, a.tokens, a.device, dtype)
        ids = torch.randint(1, model.config.vocab_size, (a.B, a.L), device=a.device)
        kw = dict(do_sample=False, pad_token_id=0)
        if peer == "flexdma-static":
            kw["cache_implementation"] = "static"
        with torch.no_grad():
            # Compiles, captures and warms outside the profiled calls (the static cache's length
            # and shapes are the profiled call's: no recompile there).
            model.generate(ids, max_new_tokens=a.tokens + 1, min_new_tokens=a.tokens + 1, **kw)
            sync()
            # One call of the prompt alone and one with the new tokens: the difference is theirs.
            times = []
            for n in (1, a.tokens + 1):
                s = time.perf_counter()
                model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
                sync()
                times.append(time.perf_counter() - s)
            per_token_ms = (times[1] - times[0]) / a.tokens * 1e3
            with profile(activities=activities) as prof:
                model.generate(ids, max_new_tokens=a.tokens + 1, min_new_tokens=a.tokens + 1, **kw)
                sync()
        events = prof.key_averages()
        device_ops = sum(e.count for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
        print(f"\n== {peer}: B={a.B} prompt={a.L}: {per_token_ms:.2f} ms a decode token (wall); "
              f"{device_ops} device operations in the profiled call (prefill + {a.tokens} tokens)", flush=True)  # fmt: skip
        if a.device == "cuda":
            print(events.table(sort_by="self_cuda_time_total", row_limit=a.rows), flush=True)
        print(events.table(sort_by="self_cpu_time_total", row_limit=a.rows), flush=True)
        del model
        with contextlib.suppress(Exception):
            torch._dynamo.reset()


if __name__ == "__main__":
    main()
