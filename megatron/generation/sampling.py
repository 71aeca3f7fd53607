"""Choosing the next token from full-vocabulary logits: greedy, temperature, top-k, top-p.

Hand-written rather than taken from `transformers`' logits warpers: they are a few tensor lines
each, `transformers` is not a runtime dependency of Deepy, and the tests check these functions
against those warpers (tests/unit/test_generation_sampling.py).

Sampling runs on the CPU in fp32 with one `torch.Generator` per sequence, so a sample depends
only on its logits and its own seed: not on the device, the batch it shared, or the parallel layout.
"""

from __future__ import annotations

import torch

from megatron.generation.config import SamplingParams


def mask_vocab_padding(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """`[..., padded_vocab]` -> the same with the padding rows (ids >= vocab_size) at -inf:
    they are no tokens of the tokenizer and must never be generated."""
    if logits.shape[-1] > vocab_size:
        logits = logits.clone()
        logits[..., vocab_size:] = float("-inf")
    return logits


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k largest logits of each row (ties at the k-th value are kept too); 0 = all."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]  # [b, 1]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus: keep the most likely tokens until their probability reaches p (always at least
    one); 0 or 1 = all."""
    if p <= 0.0 or p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    before = torch.cumsum(probs, dim=-1) - probs  # probability mass ranked above each token
    drop_sorted = before >= p  # the first token has 0 before it, so it always stays
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def filtered_logits(logits: torch.Tensor, config: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, then top-p (the order GPT-NeoX and `transformers` apply them)."""
    temperature = config.temperature if config.temperature > 0 else 1.0
    logits = logits.float() / temperature
    logits = top_k_filter(logits, config.top_k)
    return top_p_filter(logits, config.top_p)


def choose_tokens(logits: torch.Tensor, config: SamplingParams, generators: list[torch.Generator]) -> torch.Tensor:
    """Next token per row from `logits` `[b, v]` (padding already masked): argmax when greedy,
    else one draw per row from the filtered distribution with that row's generator. -> `[b]` int64 (CPU)."""
    logits = logits.detach().float().cpu()
    if config.greedy:
        return logits.argmax(dim=-1)
    probs = torch.softmax(filtered_logits(logits, config), dim=-1)
    rows = [torch.multinomial(probs[i], 1, generator=generators[i]) for i in range(probs.shape[0])]
    return torch.cat(rows)


def sample_generator(seed: int, sample_index: int) -> torch.Generator:
    """The generator of sample `sample_index`: a fixed function of (seed, index)."""
    # a large odd multiplier spreads consecutive indices over the 64-bit seed space
    mixed = (seed * 0x9E3779B97F4A7C15 + sample_index * 0xBF58476D1CE4E5B9 + 1) % (2**63)
    return torch.Generator().manual_seed(mixed)
