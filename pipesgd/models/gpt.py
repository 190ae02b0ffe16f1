"""A small decoder-only transformer (GPT-2 shape) for byte-level language modelling.

Token and learned position embeddings, ``n_layer`` pre-norm blocks (causal multi-head
self-attention, then a 4x GELU MLP, each around a residual), a final LayerNorm and an output
projection tied to the token embedding. Initialisation follows GPT-2: N(0, 0.02) weights, zero
biases, residual projections scaled by 1/sqrt(2·n_layer). Input: int64 tokens B x T (T <=
``block_size``); output: logits B x T x ``vocab_size``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def _check(name: str, value: object, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"model.{name} must be an integer >= {low}, got {value!r}")
    return value


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.n_head, self.dropout = n_head, dropout
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)  # a residual projection: scaled at initialisation

    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
                   for z in self.qkv(x).split(c, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    """Pre-norm: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout)
        # mlp[2] is a residual projection: scaled at initialisation
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd),
                                 nn.Dropout(dropout))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """``vocab_size`` and ``block_size`` come from the dataset (``model_inputs``); the rest is
    conf/model/gpt.yaml. Parameters: about ``12·n_layer·n_embd² + (vocab_size + block_size)·n_embd``."""

    def __init__(self, vocab_size: int = 256, block_size: int = 128, n_layer: int = 6, n_head: int = 4,
                 n_embd: int = 128, dropout: float = 0.0) -> None:
        super().__init__()
        for name, value in (("vocab_size", vocab_size), ("block_size", block_size), ("n_layer", n_layer),
                            ("n_head", n_head), ("n_embd", n_embd)):
            _check(name, value)
        if n_embd % n_head:
            raise ValueError(f"model.n_embd={n_embd} must be a multiple of model.n_head={n_head}")
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
            raise ValueError(f"model.dropout must be a number in [0, 1), got {dropout!r}")
        self.block_size = block_size
        self.tok = nn.Embedding(vocab_size, n_embd)
        self.pos = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)
        self.head.weight = self.tok.weight  # tied: one parameter, counted and reduced once
        # the projections into the residual stream (2·n_layer terms add up there) start smaller
        residual = {id(m) for b in self.blocks for m in (b.attn.proj, b.mlp[2])}
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, 0.0, 0.02 / math.sqrt(2 * n_layer) if id(m) in residual else 0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, tokens: Tensor) -> Tensor:
        t = tokens.shape[1]
        if t > self.block_size:
            raise ValueError(f"GPT: a sequence of {t} tokens is longer than model.block_size={self.block_size}")
        x = self.drop(self.tok(tokens) + self.pos(torch.arange(t, device=tokens.device)))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))
