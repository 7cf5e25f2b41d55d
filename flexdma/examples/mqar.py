"""Multi-query associative recall (MQAR) with a small dynamic-mask-attention language model.

Each sequence lists key-value pairs, then asks for some of the keys again; the model must emit the
value that was paired with each queried key. Accuracy is measured on the query positions only.

    python -m flexdma.examples.mqar [--steps N] [--seed S] [--backend auto] [--plot curve.png]
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from .._dispatch import BACKENDS
from ..nn import DynamicMaskAttention, rotary_cos_sin


@dataclass
class MQARConfig:
    num_keys: int = 32  # key tokens are 0 .. num_keys-1
    num_values: int = 32  # value tokens follow the keys in the vocabulary
    num_pairs: int = 8
    num_queries: int = 8

    @property
    def vocab_size(self) -> int:
        return self.num_keys + self.num_values

    @property
    def seq_len(self) -> int:
        return 2 * self.num_pairs + self.num_queries


def make_batch(
    cfg: MQARConfig, batch: int, generator: torch.Generator, device: torch.device
) -> Tuple[torch.Tensor, torch.Tensor]:
    """tokens (B, S) and targets (B, S), with target -100 everywhere except the query positions."""
    keys = torch.rand(batch, cfg.num_keys, generator=generator).argsort(-1)[:, : cfg.num_pairs]
    values = torch.randint(cfg.num_values, (batch, cfg.num_pairs), generator=generator) + cfg.num_keys
    pairs = torch.stack((keys, values), dim=-1).reshape(batch, 2 * cfg.num_pairs)
    pick = torch.randint(cfg.num_pairs, (batch, cfg.num_queries), generator=generator)
    queries = keys.gather(1, pick)
    tokens = torch.cat((pairs, queries), dim=1)
    targets = torch.full_like(tokens, -100)
    targets[:, 2 * cfg.num_pairs :] = values.gather(1, pick)
    return tokens.to(device), targets.to(device)


class Block(nn.Module):
    def __init__(self, dim: int, num_heads: int, num_kv_heads: int, keep_window_size: int, backend: str):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = DynamicMaskAttention(
            dim, num_heads, num_kv_heads, keep_window_size=keep_window_size, backend=backend
        )
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, rope: Tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rope)
        return x + self.mlp(self.norm2(x))


class DMALanguageModel(nn.Module):
    """Token embedding, `num_layers` pre-norm blocks (DynamicMaskAttention + MLP), tied-free head."""

    def __init__(
        self,
        vocab_size: int,
        dim: int = 64,
        num_layers: int = 2,
        num_heads: int = 4,
        num_kv_heads: int = 2,
        keep_window_size: int = 2048,
        backend: str = "auto",
    ):
        super().__init__()
        self.head_dim = dim // num_heads
        self.embed = nn.Embedding(vocab_size, dim)
        self.blocks = nn.ModuleList(
            Block(dim, num_heads, num_kv_heads, keep_window_size, backend) for _ in range(num_layers)
        )
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        rope = rotary_cos_sin(torch.arange(tokens.shape[1], device=tokens.device), self.head_dim, dtype=x.dtype)
        for block in self.blocks:
            x = block(x, rope)
        return self.head(self.norm(x))


def accuracy(logits: torch.Tensor, targets: torch.Tensor) -> float:
    sel = targets != -100
    return (logits.argmax(-1)[sel] == targets[sel]).float().mean().item()


def train(
    steps: int = 1500,
    seed: int = 0,
    backend: str = "auto",
    batch: int = 64,
    lr: float = 3e-3,
    dim: int = 64,
    keep_window_size: int = 18,
    cfg: Optional[MQARConfig] = None,
    device: Optional[torch.device] = None,
    eval_every: int = 50,
    progress: bool = True,
) -> dict:
    """Train on freshly sampled batches; returns the learning curve and the final held-out accuracy."""
    cfg = cfg or MQARConfig()
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = DMALanguageModel(cfg.vocab_size, dim=dim, keep_window_size=keep_window_size, backend=backend).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / steps)))
    )
    try:
        from tqdm import tqdm

        bar = tqdm(range(steps), desc="mqar", disable=not progress)
    except ImportError:
        bar = None
    curve: List[Tuple[int, float, float]] = []
    ema_acc = None
    for step in bar if bar is not None else range(steps):
        tokens, targets = make_batch(cfg, batch, gen, device)
        logits = model(tokens)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        acc = accuracy(logits.detach(), targets)
        ema_acc = acc if ema_acc is None else 0.9 * ema_acc + 0.1 * acc
        if step % eval_every == 0 or step == steps - 1:
            curve.append((step, loss.item(), acc))
            if bar is not None:
                bar.set_postfix(loss=f"{loss.item():.3f}", acc=f"{ema_acc:.3f}")
            elif progress:
                print(f"step {step:5d}  loss {loss.item():.4f}  acc {ema_acc:.3f}", flush=True)
    model.eval()
    with torch.no_grad():
        test_gen = torch.Generator().manual_seed(seed + 1_000_003)
        accs = [accuracy(model(t), y) for t, y in (make_batch(cfg, 256, test_gen, device) for _ in range(4))]
    return {"curve": curve, "test_accuracy": sum(accs) / len(accs), "chance": 1.0 / cfg.num_values, "model": model}


def plot_curve(curve, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise SystemExit("--plot needs matplotlib: pip install matplotlib") from e
    steps, losses, accs = zip(*curve)
    fig, ax1 = plt.subplots(figsize=(6, 4))
    ax1.plot(steps, losses, color="tab:blue")
    ax1.set_xlabel("step")
    ax1.set_ylabel("loss", color="tab:blue")
    ax2 = ax1.twinx()
    ax2.plot(steps, accs, color="tab:orange")
    ax2.set_ylabel("query accuracy", color="tab:orange")
    ax2.set_ylim(0, 1)
    ax1.set_title("MQAR with dynamic mask attention")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text}")
    return value


def main(argv: Optional[List[str]] = None) -> dict:

    p = argparse.ArgumentParser(
        prog="python -m flexdma.examples.mqar",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--steps", type=_positive_int, default=1500, help="training steps")
    p.add_argument("--seed", type=int, default=0, help="seed of the model and the data")
    p.add_argument("--backend", default="auto", choices=BACKENDS, help="flash_dma_attention backend")
    p.add_argument("--batch", type=_positive_int, default=64, help="sequences per step")
    p.add_argument("--lr", type=_positive_float, default=3e-3, help="peak learning rate")
    # 18 of the 24 positions: the late query rows must drop keys, so the learned importance matters.
    p.add_argument("--keep-window-size", type=_positive_int, default=18, help="keys kept per query")
    p.add_argument("--plot", metavar="PNG", help="write the learning curve to this file (needs matplotlib)")
    p.add_argument(
        "--threads",
        type=_positive_int,
        default=1,
        help="CPU threads (1: at this model size, thread synchronization costs more than it saves)",
    )
    args = p.parse_args(argv)
    if args.plot:
        # Checked before training, not after minutes of it.
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            p.error("--plot needs matplotlib: pip install matplotlib")
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    res = train(
        steps=args.steps,
        seed=args.seed,
        backend=args.backend,
        batch=args.batch,
        lr=args.lr,
        keep_window_size=args.keep_window_size,
    )
    elapsed = time.perf_counter() - t0
    print(
        f"final test accuracy {res['test_accuracy']:.4f} (chance {res['chance']:.4f}) "
        f"after {args.steps} steps in {elapsed:.1f} s"
    )
    if args.plot:
        plot_curve(res["curve"], args.plot)
        print(f"learning curve written to {args.plot}")
    return res


if __name__ == "__main__":
    main()
