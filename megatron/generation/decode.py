"""Autoregressive generation over a `ModelReplica`: batched, KV-cached, stopping at EOD.

Prompts of one batch are left-padded to the same width. Each row gets its own position ids
(0 at its first real token) and an attention mask that hides the padding keys, so a padded row
computes exactly what it would compute alone. A padding query may attend to itself only: a
query with every key masked would give NaN, and NaN values would leak through the masked keys'
zero weights into later rows of the same softmax.

With the cache (the default) the first forward runs the whole prompt and every later one only the
newest token; `recompute: true` runs the whole sequence each time (the check that the cache is
exact). Rows that finish (EOD, a stop condition, their token budget) leave the batch, and their
keys/values leave the cache, so a long generation is not slowed by the finished ones.

Every rank of the replica runs this loop with the same prompts: the last stage chooses the tokens,
tp rank 0 of it decides, and the choice is broadcast to every rank, so all ranks agree on which
rows go on.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from megatron.generation.config import SamplingParams
from megatron.generation.replica import ModelReplica
from megatron.generation.sampling import choose_tokens
from megatron.logging.log import get_logger
from megatron.model.kv_cache import KVCache

StopCondition = Callable[[int, list[int]], bool]
"""(index of the prompt, its generated tokens so far) -> True to stop it (e.g. a stop string appeared)."""


@dataclass(frozen=True)
class Generated:
    prompt: list[int]
    """The prompt tokens the model saw (left-truncated to fit; `[eod]` for an empty prompt)."""
    tokens: list[int]
    """Generated tokens, without the EOD that ended them."""
    finished: bool
    """True when EOD or the stop condition ended the row; False when it ran out of tokens."""
    logits: list[list[float]] | None = None
    """With `return_logits`: the logits over the real vocabulary before each generated token."""


def fit_prompt(prompt: list[int], max_length: int, eod: int) -> list[int]:
    """An empty prompt starts from EOD (a document boundary); a prompt with no room left for one
    new token keeps its last `max_length - 1` tokens."""
    if not prompt:
        return [eod]
    if len(prompt) >= max_length:
        get_logger().warning("a prompt of %d tokens is longer than seq_length - 1 = %d: keeping its last %d tokens",
                             len(prompt), max_length - 1, max_length - 1)
        return prompt[-(max_length - 1) :]
    return list(prompt)


def _attention_mask(key_real: torch.Tensor, queries: int) -> torch.Tensor:
    """`[b, 1, queries, keys]` bool: real keys, plus each query's own position (see the module doc)."""
    b, keys = key_real.shape
    past = keys - queries
    allowed = key_real[:, None, None, :].expand(b, 1, queries, keys).clone()
    q = torch.arange(queries)
    allowed[:, :, q, past + q] = True
    return allowed


def _keep_rows(cache: KVCache, rows: torch.Tensor) -> None:
    for layer, (k, v) in list(cache.layers.items()):
        index = rows.to(k.device)
        cache.layers[layer] = (k.index_select(0, index), v.index_select(0, index))
    for shared in cache.positions.values():  # the caches of blocks that run at several positions
        _keep_rows(shared, rows)


class _Batch:
    """The active rows: their tokens so far, which of them are real, and their positions."""

    def __init__(self, prompts: list[list[int]], eod: int) -> None:
        width = max(len(p) for p in prompts)
        self.tokens = torch.full((len(prompts), width), eod, dtype=torch.long)
        self.real = torch.zeros((len(prompts), width), dtype=torch.bool)
        for i, p in enumerate(prompts):
            self.tokens[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            self.real[i, width - len(p) :] = True
        self.positions = (self.real.long().cumsum(dim=1) - 1).clamp(min=0)
        self.padded = bool((~self.real).any())

    def append(self, new: torch.Tensor) -> None:
        self.tokens = torch.cat([self.tokens, new.view(-1, 1)], dim=1)
        self.real = torch.cat([self.real, torch.ones_like(new, dtype=torch.bool).view(-1, 1)], dim=1)
        self.positions = torch.cat([self.positions, self.positions[:, -1:] + 1], dim=1)

    def keep(self, rows: torch.Tensor) -> None:
        self.tokens, self.real, self.positions = self.tokens[rows], self.real[rows], self.positions[rows]


def generate(
    replica: ModelReplica,
    prompts: list[list[int]],
    sampling: SamplingParams,
    *,
    eod: int,
    max_length: int,
    generators: list[torch.Generator],
    stop: StopCondition | None = None,
) -> list[Generated]:
    """Complete every prompt (one batch); call on every rank of the replica with the same arguments.

    `max_length` (seq_length) bounds prompt + generated tokens; `generators` holds one per prompt
    (used only when sampling).
    """
    fitted = [fit_prompt(p, max_length, eod) for p in prompts]
    budgets = [min(sampling.maximum_tokens, max_length - len(p)) for p in fitted]
    out_tokens: list[list[int]] = [[] for _ in fitted]
    out_logits: list[list[list[float]]] = [[] for _ in fitted]
    finished = [False] * len(fitted)

    batch = _Batch(fitted, eod)
    active = list(range(len(fitted)))  # original index of each row still in the batch
    cache = None if sampling.recompute else KVCache()
    fed = 0  # columns of batch.tokens the cache already holds
    vocab = replica.vocab_size
    while active:
        queries = batch.tokens.shape[1] - fed
        mask = _attention_mask(batch.real, queries) if batch.padded else None
        logits = replica.logits(batch.tokens[:, fed:], batch.positions[:, fed:], mask, cache)
        if cache is not None:
            fed = batch.tokens.shape[1]

        chosen: torch.Tensor | None = None
        kept: torch.Tensor | None = None
        if replica.is_last_stage:
            assert logits is not None
            last = replica.full_vocab(logits[:, -1, :])  # [rows, padded vocab], fp32
            chosen = replica.share_from_tp_source(choose_tokens(last, sampling, [generators[i] for i in active]))
            kept = last[:, :vocab] if sampling.return_logits else None
        rows = len(active)
        chosen = replica.share_from_last_stage(chosen, (rows,), torch.long).cpu()
        if sampling.return_logits:
            kept = replica.share_from_last_stage(kept, (rows, vocab), torch.float32).cpu()

        still: list[int] = []
        for row, index in enumerate(active):
            token = int(chosen[row])
            if token == eod:
                finished[index] = True
                continue
            out_tokens[index].append(token)
            if kept is not None:
                out_logits[index].append(kept[row].tolist())
            if stop is not None and stop(index, out_tokens[index]):
                finished[index] = True
            elif len(out_tokens[index]) < budgets[index]:
                still.append(row)
        if not still:
            break
        batch.append(chosen)
        if len(still) < rows:
            keep = torch.tensor(still, dtype=torch.long)
            batch.keep(keep)
            if cache is not None:
                _keep_rows(cache, keep)
            active = [active[row] for row in still]
    return [
        Generated(prompt=fitted[i], tokens=out_tokens[i], finished=finished[i],
                  logits=out_logits[i] if sampling.return_logits else None)
        for i in range(len(fitted))
    ]
