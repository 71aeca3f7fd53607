"""A plain GPT in the nanoGPT manner, for the side-by-side benchmark: the baseline a user writes by
hand in one file with nothing but PyTorch (no tensor-parallel layers, no trainer, no engine).

Same architecture as Deepy's GPT-NeoX-style model in `tools/bench/compare.py`: pre-layernorm
blocks, fused QKV, rotary on every head dim (half-split layout, cos/sin tables computed once),
causal SDPA, GELU MLP of 4x width, biases everywhere, untied output head, no dropout. Activations
are batch-first `[b, s, h]`, as in nanoGPT.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x `[b, n, s, d]` rotated by the angles whose cos/sin are `[s, d]` (dim i pairs with i + d/2)."""
    half = x.shape[-1] // 2
    rotated_half = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated_half * sin


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(x).split(h, dim=2)
        q, k, v = (t.view(b, s, self.heads, h // self.heads).transpose(1, 2) for t in (q, k, v))  # [b, n, s, d]
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [b, n, s, d]
        return self.proj(y.transpose(1, 2).reshape(b, s, h))


class MLP(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.fc = nn.Linear(hidden, 4 * hidden)
        self.proj = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(hidden)
        self.attn = Attention(hidden, heads)
        self.ln_2 = nn.LayerNorm(hidden)
        self.mlp = MLP(hidden)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), cos, sin)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    cos: torch.Tensor  # registered buffers
    sin: torch.Tensor

    def __init__(self, *, layers: int, hidden: int, heads: int, seq: int, vocab: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        d = hidden // heads
        inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
        angles = torch.outer(torch.arange(seq, dtype=torch.float32), inv_freq)  # [s, d/2]
        angles = torch.cat([angles, angles], dim=-1)  # [s, d]
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
                if isinstance(module, nn.Linear) and module.bias is not None:
                    nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token loss of `targets` `[b, s]` given `idx` `[b, s]`."""
        s = idx.shape[1]
        cos, sin = self.cos[:s].to(self.wte.weight.dtype), self.sin[:s].to(self.wte.weight.dtype)
        x = self.wte(idx)
        for block in self.blocks:
            x = block(x, cos, sin)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def adamw(model: nn.Module, lr: float, weight_decay: float, betas: tuple[float, float]) -> torch.optim.AdamW:
    """AdamW with decay on matrices only, torch's fused kernel where the device has one."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    try:
        return torch.optim.AdamW(groups, lr=lr, betas=betas, fused=True)
    except (RuntimeError, TypeError, ValueError):  # no fused kernel for this device
        return torch.optim.AdamW(groups, lr=lr, betas=betas, foreach=True)
