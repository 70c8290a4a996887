"""Models for the benchmark recipe that torchvision does not have: a Linear-heavy Transformer stack.

Plain PyTorch, every projection an ``nn.Linear`` (attention's q, k, v and output too, no
``nn.MultiheadAttention``), so precisions that convert ``nn.Linear`` layers reach all of them.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["REFERENCE", "TINY", "LARGE", "SIZES", "describe", "TransformerStack", "lm_loss", "random_tokens",
           "noisy_bigrams"]

# The reference configuration (the recipe's CUDA default) and a tiny one for the CPU.
REFERENCE = {"layers": 4, "d_model": 2048, "d_ff": 8192, "heads": 16, "seq_len": 1024, "vocab": 8192}
TINY = {"layers": 2, "d_model": 64, "d_ff": 256, "heads": 4, "seq_len": 32, "vocab": 256}
# Where fp8 pays: matmuls of 8192 tokens x 4096 -> 16384 and back (877M parameters with 4 layers).
LARGE = {"layers": 4, "d_model": 4096, "d_ff": 16384, "heads": 32, "seq_len": 1024, "vocab": 8192}
SIZES = {"tiny": TINY, "reference": REFERENCE, "large": LARGE}


def describe(sizes: dict) -> str:
    """"4 layers, d_model 4096, d_ff 16384, 32 heads, 877M parameters" for a dict of sizes such as LARGE."""
    with torch.device("meta"):  # counted without allocating
        n = sum(p.numel() for p in TransformerStack(**sizes).parameters())
    count = f"{n / 1e6:.0f}M" if n >= 10**6 else f"{n:,}"
    return f"{sizes['layers']} layers, d_model {sizes['d_model']}, d_ff {sizes['d_ff']}, {sizes['heads']} heads, {count} parameters"


class _CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention from four ``nn.Linear`` layers and ``scaled_dot_product_attention``."""

    def __init__(self, d_model: int, heads: int):
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(d_model, d_model)
        self.k = nn.Linear(d_model, d_model)
        self.v = nn.Linear(d_model, d_model)
        self.out = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (proj(x).view(b, t, self.heads, d // self.heads).transpose(1, 2) for proj in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, d))


class _Block(nn.Module):
    """A pre-norm Transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, d_model: int, d_ff: int, heads: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = _CausalSelfAttention(d_model, heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, d_ff), nn.GELU(), nn.Linear(d_ff, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TransformerStack(nn.Module):
    """A decoder-only Transformer: token ids (batch, seq) in, logits (batch, seq, vocab) out.

    Token embedding plus learned positions, ``layers`` pre-norm blocks (causal self-attention and
    a Linear(d_model, d_ff)-GELU-Linear(d_ff, d_model) MLP), a final LayerNorm and a
    Linear(d_model, vocab) head. ``seq_len`` is the longest sequence it takes.
    """

    def __init__(self, layers: int, d_model: int, d_ff: int, heads: int, vocab: int = 8192, seq_len: int = 1024):
        super().__init__()
        self.seq_len = seq_len
        self.tokens = nn.Embedding(vocab, d_model)
        self.positions = nn.Embedding(seq_len, d_model)
        self.blocks = nn.Sequential(*(_Block(d_model, d_ff, heads) for _ in range(layers)))
        self.ln = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        if t > self.seq_len:
            raise ValueError(f"sequence of {t} tokens is longer than the model's seq_len {self.seq_len}")
        x = self.tokens(ids) + self.positions(torch.arange(t, device=ids.device))
        return self.head(self.ln(self.blocks(x)))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy over (batch * seq, vocab)."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def random_tokens(batch: int, seq_len: int, vocab: int, device: torch.device | str = "cpu", seed: int | None = None):
    """Random token ids ``(inputs, targets)``, each (batch, seq_len), the targets being the next tokens."""
    g = torch.Generator(device="cpu").manual_seed(batch if seed is None else seed)
    ids = torch.randint(0, vocab, (batch, seq_len + 1), generator=g)
    return ids[:, :-1].contiguous().to(device), ids[:, 1:].contiguous().to(device)


def noisy_bigrams(steps: int, batch: int, seq_len: int, vocab: int, device: torch.device | str = "cpu",
                  seed: int = 0):
    """``steps`` (inputs, targets) batches: each next token is perm[token] with probability 1/2, else uniform."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(vocab, generator=g)
    out = []
    for _ in range(steps):
        ids = torch.empty(batch, seq_len + 1, dtype=torch.long)
        ids[:, 0] = torch.randint(0, vocab, (batch,), generator=g)
        follow = torch.rand(batch, seq_len, generator=g) < 0.5
        noise = torch.randint(0, vocab, (batch, seq_len), generator=g)
        for t in range(seq_len):
            ids[:, t + 1] = torch.where(follow[:, t], perm[ids[:, t]], noise[:, t])
        out.append((ids[:, :-1].to(device), ids[:, 1:].to(device)))
    return out
