"""A small GPT-style decoder (a few million parameters at the default size)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class GptConfig:
    vocab_size: int
    context: int = 64
    d_model: int = 192
    n_layers: int = 6
    n_heads: int = 6


class Block(nn.Module):
    def __init__(self, cfg: GptConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = nn.MultiheadAttention(cfg.d_model, cfg.n_heads, batch_first=True)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(nn.Linear(cfg.d_model, 4 * cfg.d_model), nn.GELU(),
                                 nn.Linear(4 * cfg.d_model, cfg.d_model))
        mask = torch.triu(torch.ones(cfg.context, cfg.context, dtype=torch.bool), diagonal=1)
        self.register_buffer("causal_mask", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        h = self.ln1(x)
        attended, _ = self.attn(h, h, h, attn_mask=self.causal_mask[:t, :t], need_weights=False)
        x = x + attended
        return x + self.mlp(self.ln2(x))


class Gpt(nn.Module):
    def __init__(self, cfg: GptConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.context, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """The logits, or with ``targets`` the loss: through ``__call__`` either way, so
        FSDP2's and DDP's forward hooks run."""
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok(tokens) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        if targets is None:
            return logits
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                           targets.reshape(-1))

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self(tokens, targets)
