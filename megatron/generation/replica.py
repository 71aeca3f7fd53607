"""One copy of the model (its tensor x pipeline ranks) as a function tokens -> logits, for inference.

Training runs the pipeline through DeepSpeed's `PipelineEngine`, whose schedule knows micro-batches
and backward passes but nothing of key/value caches or token-by-token decoding. For inference the
stage a rank holds is run here instead: the first stage embeds the tokens, each stage runs its
blocks (with this stage's `KVCache`) and sends the hidden state `[s, b, h]` to the next stage with
`torch.distributed.send/recv`; the last stage applies the final norm and the (tied or own) head.
The plain `GPTModel` (`pipe_parallel_size: 0`) is one stage that does all of it.

Every rank of the replica calls `logits` with the same tokens (they are broadcast before), so
shapes are known everywhere and no shape has to travel. Logits exist on the last stage only, as
each tp rank's vocabulary shard `[b, s, v/tp]`; the helpers below turn them into full-vocabulary
logits, per-token log-probabilities or argmax tokens without gathering more than needed, and
share small results with the rest of the replica.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from deepspeed.pipe import PipelineModule
from torch import nn

from megatron.generation.sampling import mask_vocab_padding
from megatron.model.embedding import GPTEmbedding
from megatron.model.gpt import GPTModel
from megatron.model.block import Block
from megatron.model.kv_cache import KVCache
from megatron.model.pipeline import FinalNormPipe, OutputLayerPipe, tied_embedding_logits
from megatron.mpu import topology
from megatron.mpu.cross_entropy import vocab_parallel_cross_entropy
from megatron.mpu.mappings import gather_from_tensor_model_parallel_region

_T = TypeVar("_T")


def _stage_parts(module: PipelineModule) -> list[tuple[str, Callable[..., Any]]]:
    """This rank's pipeline stage as ("embed" | "layer" | "norm" | "head", callable), in order."""
    parts: list[tuple[str, Callable[..., Any]]] = []
    for fn in module.forward_funcs:
        if isinstance(fn, Block):
            # the block itself, not the pipe wrapper's tuple interface: it takes the cache
            parts.append(("layer", fn.block_forward))
        elif isinstance(fn, GPTEmbedding):
            parts.append(("embed", functools.partial(GPTEmbedding.forward, fn)))
        elif isinstance(fn, FinalNormPipe):
            parts.append(("norm", fn.final_norm))
        elif isinstance(fn, OutputLayerPipe):
            parts.append(("head", fn))
        elif isinstance(fn, functools.partial) and fn.func is tied_embedding_logits:
            parts.append(("head", fn))
        else:  # e.g. a reward model's ValueHeadPipe: refused by the caller before this point
            raise TypeError(f"unexpected pipeline layer {type(fn).__name__} in an inference stage")
    return parts


class ModelReplica:
    """The part of one model copy that this rank holds, plus the collectives between its parts."""

    def __init__(self, module: nn.Module, *, vocab_size: int, hidden_size: int) -> None:
        self.module = module.eval()
        self.vocab_size = vocab_size
        """Real tokens; rows beyond it are tensor-parallel padding and never generated."""
        first_param = next(module.parameters())
        self.device = first_param.device
        self.dtype = first_param.dtype
        self.pipelined = isinstance(module, PipelineModule)
        if isinstance(module, GPTModel) and module.value_head is not None:
            raise ValueError("a model with a value head has no token logits to generate from")
        self.parts = _stage_parts(module) if isinstance(module, PipelineModule) else []
        self.hidden_size = hidden_size
        coords = topology.get_coordinates() if topology.model_parallel_is_initialized() else None
        self.tp_rank = coords.tp if coords else 0
        self.tp_size = topology.get_tensor_model_parallel_world_size()
        self.pp_rank = coords.pp if coords else 0
        self.pp_size = topology.get_pipe_parallel_world_size()
        self.dp_rank = coords.dp if coords else 0
        self.dp_size = topology.get_data_parallel_world_size()
        topo = topology.get_topology() if coords else None

        def rank_at(pipe: int) -> int:
            assert topo is not None and coords is not None
            return int(topo.get_rank(pipe=pipe, data=coords.dp, model=coords.tp))

        self._prev_rank = rank_at(self.pp_rank - 1) if self.pp_rank > 0 else None
        self._next_rank = rank_at(self.pp_rank + 1) if self.pp_rank < self.pp_size - 1 else None
        self._last_stage_rank = rank_at(self.pp_size - 1) if topo is not None else 0

    # --- where this rank sits ------------------------------------------------------------------
    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def speaks_for_replica(self) -> bool:
        """tp 0 of the first stage: the rank that hands this replica's results on."""
        return self.tp_rank == 0 and self.pp_rank == 0

    # --- the forward ---------------------------------------------------------------------------
    @torch.no_grad()
    def logits(
        self,
        tokens: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
    ) -> torch.Tensor | None:
        """tokens `[b, s]` (the same on every rank of the replica) -> this tp rank's logits shard
        `[b, s, v/tp]` on the last stage, None on the others. With `kv_cache` the tokens follow
        the ones already cached (each rank keeps the cache of its own layers)."""
        tokens = tokens.to(self.device)
        position_ids = position_ids.to(self.device)
        if attention_mask is not None:
            attention_mask = attention_mask.to(self.device)
        if not self.pipelined:
            return self.module(tokens, position_ids, attention_mask, kv_cache)
        b, s = tokens.shape
        x: torch.Tensor | None = None
        if not self.is_first_stage:
            x = torch.empty(s, b, self.hidden_size, dtype=self.dtype, device=self.device)
            dist.recv(x, src=self._prev_rank)
        out: torch.Tensor | None = None
        for kind, part in self.parts:
            if kind == "embed" and x is None:
                x = part(tokens, position_ids)  # [s, b, h]
            elif kind == "layer":
                x = part(x, position_ids, attention_mask, kv_cache)  # [s, b, h]
            elif kind == "norm":
                x = part(x)
            elif kind == "head":
                out = part(x)  # [b, s, v/tp]
        if kv_cache is not None:
            kv_cache.seen += s
        if self._next_rank is not None:
            assert x is not None
            dist.send(x.contiguous(), dst=self._next_rank)
            return None
        return out

    # --- vocabulary-parallel logits ------------------------------------------------------------
    def full_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """`[..., v/tp]` shards -> fp32 `[..., padded_vocab]` with the padding rows at -inf."""
        full = gather_from_tensor_model_parallel_region(logits.contiguous()).float()
        return mask_vocab_padding(full, self.vocab_size)

    def token_logprobs(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """log p(target) `[b, s]` (fp32) from the shards, without gathering them: exactly minus the
        training loss per token (softmax over the whole padded vocabulary, as the loss does)."""
        return -vocab_parallel_cross_entropy(logits, targets.to(logits.device))

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """The most likely real token `[...]` (int64) from the shards: each tp rank finds its best
        candidate, the candidates are gathered and the highest wins (ties -> lowest id, as
        `torch.argmax` on the full logits)."""
        local = logits.float()
        width = local.shape[-1]
        start = self.tp_rank * width
        if start + width > self.vocab_size:
            local = local.clone()
            local[..., max(0, self.vocab_size - start) :] = float("-inf")
        index = local.argmax(dim=-1)
        best = local.gather(-1, index.unsqueeze(-1)).squeeze(-1)
        index = index + start
        if self.tp_size == 1:
            return index
        group = topology.get_tensor_model_parallel_group()
        bests = [torch.empty_like(best) for _ in range(self.tp_size)]
        indices = [torch.empty_like(index) for _ in range(self.tp_size)]
        dist.all_gather(bests, best.contiguous(), group=group)
        dist.all_gather(indices, index.contiguous(), group=group)
        winner = torch.stack(bests).argmax(dim=0, keepdim=True)  # first maximum = lowest rank
        return torch.stack(indices).gather(0, winner).squeeze(0)

    # --- sharing results inside the replica ----------------------------------------------------
    def share_from_last_stage(self, value: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """`value` (computed on the last stage, identical on its tp ranks) on every rank of the replica."""
        if self.pp_size == 1:
            assert value is not None
            return value
        if self.is_last_stage:
            assert value is not None
            buffer = value.to(device=self.device, dtype=dtype).contiguous()
        else:
            buffer = torch.empty(shape, dtype=dtype, device=self.device)
        dist.broadcast(buffer, src=self._last_stage_rank, group=topology.get_pipe_parallel_group())
        return buffer

    def share_from_tp_source(self, value: torch.Tensor) -> torch.Tensor:
        """tp rank 0's `value` on every tp rank (a sampled token must be the same everywhere)."""
        if self.tp_size == 1:
            return value
        buffer = value.to(self.device).contiguous()
        dist.broadcast(buffer, src=topology.get_tensor_model_parallel_src_rank(),
                       group=topology.get_tensor_model_parallel_group())
        return buffer

    def gather_over_replicas(self, value: _T) -> list[_T]:
        """Every data-parallel replica's `value` (index = dp rank; every rank passes the same type), on every rank."""
        if self.dp_size == 1:
            return [value]
        gathered: list[Any] = [None] * self.dp_size
        dist.all_gather_object(gathered, value, group=topology.get_data_parallel_group())
        return gathered
