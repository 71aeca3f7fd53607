"""Re-drawing some tokens' rows of the token embedding and the output layer when a run starts (``reinit_tokens``).

Levanter's ``sft.py`` (stanford-crfm/levanter at 9263f81e, ``src/levanter/main/sft.py:245-274`` and
``reinitialize_some_tokens``/``_reinit_embed_vectors``, lines 305-360): at step 0 only (a resumed run keeps its
rows), after the starting weights are loaded, each named token's row of the embedding (``reinit_embeddings``) and of
the LM head (``reinit_lm_head``) becomes ``truncated_normal(-3, 3) * std + mean``, where ``mean`` and ``std`` are the
per-hidden-unit mean and population standard deviation over the matrix's vocabulary rows (the re-drawn tokens'
own rows included, as there). Levanter's HF start resizes the vocabulary to ``len(tokenizer)`` first (sft.py:213), so
its statistics cover the tokenizer's rows; here they cover the same rows, not the padding Deepy adds for tensor
parallelism. The draws come from ``(seed, matrix name)``, so every tensor-parallel, pipeline and data-parallel rank
draws the same numbers and keeps the rows it holds; the mean and std are summed over the tensor-parallel group.
Under ZeRO-3 each matrix is gathered whole first (every rank draws the same rows, rank 0's are kept) and partitioned
again, so the rows do not depend on the ZeRO stage; the optimizer's fp32 partitions are then refreshed from them.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from megatron import mpu
from megatron.checkpointing.partitioned_load import editing_whole
from megatron.mpu.initialize_weights import param_generator
from megatron.mpu.layers import ColumnParallelLinear, VocabParallelEmbedding
from megatron.tokenizer.base import Tokenizer
from megatron.training.reinit_config import ReinitTokensArgs, token_ids

EMBEDDING = "embedding.word_embeddings.weight"
HEAD = "output_layer.weight"
TRUNCATION = 3.0
"""sft.py:358: ``hax.random.truncated_normal(key, ..., -3, 3)``, a standard normal cut at +-3."""


@dataclass(frozen=True)
class Target:
    """One matrix whose rows are re-drawn: this rank's vocabulary shard, its first row, the name seeding the draw."""

    weight: torch.Tensor
    first_row: int
    name: str


def targets(module: nn.Module, *, embedding: bool, head: bool) -> list[Target]:
    """The matrices this rank holds of those named: the word embedding (``VocabParallelEmbedding``, on each pipeline
    stage that holds it, the tied head's copy included) and the untied output layer."""
    found: list[Target] = []
    tp_rank = mpu.get_tensor_model_parallel_rank()
    for layer in module.modules():
        if isinstance(layer, VocabParallelEmbedding) and embedding:
            found.append(Target(layer.weight, layer.vocab_start, EMBEDDING))
        elif isinstance(layer, ColumnParallelLinear) and layer.canonical_name == "output_layer" and head:
            found.append(Target(layer.weight, tp_rank * layer.output_size_per_partition, HEAD))
    return found


def _tp_sum(t: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized() and mpu.get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(t, group=mpu.get_tensor_model_parallel_group())
    return t


@torch.no_grad()
def redraw_rows(target: Target, ids: Sequence[int], vocab_size: int, seed: int) -> None:
    """Levanter's rule on one matrix (sft.py:353-360): statistics over rows ``[0, vocab_size)`` of the whole matrix
    (this rank's shard, summed over the tensor-parallel group), draws from ``(seed, "reinit_tokens." + name)``."""
    shard = target.weight
    rows = max(0, min(shard.shape[0], vocab_size - target.first_row))
    counted = shard[:rows].float()  # [rows, h]
    mean = _tp_sum(counted.sum(0)) / vocab_size  # [h]
    std = (_tp_sum(((counted - mean) ** 2).sum(0)) / vocab_size).sqrt()  # [h], jnp.std's ddof=0
    noise = torch.empty(len(ids), shard.shape[1], dtype=torch.float32)  # [n, h], the same on every rank
    torch.nn.init.trunc_normal_(noise, mean=0.0, std=1.0, a=-TRUNCATION, b=TRUNCATION,
                                generator=param_generator(seed, f"reinit_tokens.{target.name}"))
    drawn = noise.to(shard.device) * std + mean
    for j, tid in enumerate(ids):
        local = tid - target.first_row
        if 0 <= local < shard.shape[0]:
            shard[local] = drawn[j].to(shard.dtype)


def reinit_tokens(module: nn.Module, settings: ReinitTokensArgs, tokenizer: Tokenizer, *, iteration: int,
                  tied: bool, seed: int, optimizer: object | None = None, partitioned: bool = False) -> list[str]:
    """Re-draw the rows ``settings`` names in ``module`` when the run starts at step 0 (``iteration``: the step the
    loaded state is at; call after the starting weights are loaded; a resumed run, at a later step, keeps its rows:
    sft.py:232-244); returns the matrices re-drawn in the whole model (a pipeline stage holds some of them).
    ``optimizer``: the engine's, whose fp32 copy of the weights (ZeRO, fp16/bf16) is refreshed from the module.
    ``partitioned``: ZeRO-3 partitions the module's parameters (every rank calls this, each matrix is gathered)."""
    if not settings.reinit_tokens or iteration != 0:
        return []
    ids = token_ids(tokenizer, settings.reinit_tokens)
    embedding, head = settings.redrawn(tied)
    chosen = targets(module, embedding=embedding, head=head)
    for target in chosen:
        with ExitStack() as whole:  # one matrix gathered at a time
            if partitioned:
                whole.enter_context(editing_whole([target.weight]))
            redraw_rows(target, ids, tokenizer.vocab_size, seed)
    refresh = getattr(optimizer, "refresh_fp32_params", None)
    if callable(refresh):
        refresh()  # ZeRO / fp16 / bf16 optimizers keep their own fp32 copy of the weights
    return [name for name, on in ((EMBEDDING, embedding), (HEAD, head)) if on]  # the model's, whichever stage
