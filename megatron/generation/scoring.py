"""Log-probabilities of given token sequences under a `ModelReplica` (no generation).

Used by precompute (reference log-probs for DPO/KTO) and by the lm-eval adapter (loglikelihood,
loglikelihood_rolling). A request is `(tokens, score_from)`: the model reads `tokens[:-1]` and
the result holds log p(tokens[t] | tokens[:t]) for t in [score_from, len(tokens)), plus whether
each of those tokens was the model's argmax (lm-eval's `is_greedy`).

The values are exactly minus the training loss per token (`vocab_parallel_cross_entropy` on the
vocab-parallel logits, softmax over the whole padded vocabulary), so an evaluation agrees with
the loss the model was trained on. Requests are sorted by length and run in right-padded
batches: a causal model's outputs at real positions do not depend on padding to their right.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron.generation.replica import ModelReplica


@dataclass(frozen=True)
class Scored:
    logprobs: list[float]
    """log p(token) for the scored tokens, in order."""
    greedy: list[bool]
    """Whether each scored token was the argmax over the real vocabulary."""

    @property
    def total(self) -> float:
        return float(sum(self.logprobs))


ScoreRequest = tuple[list[int], int]
"""(tokens, score_from): score tokens[score_from:], each given everything before it."""


def check_request(tokens: list[int], score_from: int, max_length: int) -> None:
    if not 1 <= score_from < len(tokens):
        raise ValueError(f"score_from={score_from} must lie in [1, {len(tokens)}) for {len(tokens)} tokens")
    if len(tokens) - 1 > max_length:
        raise ValueError(f"{len(tokens)} tokens need a context of {len(tokens) - 1} > seq_length={max_length}")


def score(replica: ModelReplica, requests: list[ScoreRequest], *, batch_size: int, max_length: int,
          eod: int) -> list[Scored]:
    """Score every request; call on every rank of the replica with the same requests."""
    for tokens, start in requests:
        check_request(tokens, start, max_length)
    order = sorted(range(len(requests)), key=lambda i: -len(requests[i][0]))
    results: dict[int, Scored] = {}
    for first in range(0, len(order), batch_size):
        chunk = order[first : first + batch_size]
        width = max(len(requests[i][0]) for i in chunk)
        padded = torch.full((len(chunk), width), eod, dtype=torch.long)
        for row, i in enumerate(chunk):
            tokens = requests[i][0]
            padded[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        inputs, targets = padded[:, :-1], padded[:, 1:]
        positions = torch.arange(width - 1).unsqueeze(0).expand(len(chunk), -1)
        logits = replica.logits(inputs, positions)
        logp = greedy = None
        if replica.is_last_stage:
            assert logits is not None
            logp = replica.token_logprobs(logits, targets)  # [b, s]
            greedy = (replica.argmax(logits).cpu() == targets).to(torch.uint8)
        shape = tuple(targets.shape)
        logp = replica.share_from_last_stage(logp, shape, torch.float32).cpu()
        greedy = replica.share_from_last_stage(greedy, shape, torch.uint8).cpu()
        for row, i in enumerate(chunk):
            tokens, start = requests[i]
            # target t-1 is token t
            span = slice(start - 1, len(tokens) - 1)
            results[i] = Scored(logprobs=logp[row, span].tolist(), greedy=[bool(g) for g in greedy[row, span]])
    return [results[i] for i in range(len(requests))]
