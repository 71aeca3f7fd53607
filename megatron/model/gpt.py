"""The GPT model: embedding -> layers (transformer, Mamba, RWKV or gMLP blocks) -> final norm -> (tied) output
projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatron.model.config import GPTConfig, ModelConfigError
from megatron.model.embedding import GPTEmbedding
from megatron.model.kv_cache import KVCache
from megatron.model.layer_sharing import sharing_owners
from megatron.model.mup import mup_scaled_input, output_mult
from megatron.model.norms import build_norm
from megatron.model.soft_prompt import SoftPrompt
from megatron.model.softcap import soft_cap
from megatron.model.soft_prompt_settings import SoftPromptSettings
from megatron.model.blocks import build_block
from megatron.mpu.initialize_weights import initialize_param_, set_tensor_model_parallel_attributes
from megatron.mpu.layers import ColumnParallelLinear, mark_partial_over_tensor_parallel, parallel_lm_logits
from megatron.mpu.mappings import gather_from_sequence_parallel_region
from megatron.mpu.topology import get_tensor_model_parallel_world_size


class OutputLayer(ColumnParallelLinear):
    """The untied output projection: hidden `[s, b, h]` (or its sequence shard) -> logits `[b, s, v/tp]`
    (vocab-parallel rows, no bias). A module of its own so that a LoRA adapter hooks it like any projection."""

    mup_output_mult = 1.0
    """muP: the input's multiplier (1 / (width multiplier x mup_output_temp)), set by ``mup.apply_base_shapes``."""

    def forward(self, x_sbh: torch.Tensor) -> torch.Tensor:
        x_sbh = mup_scaled_input(x_sbh, self.mup_output_mult)
        return parallel_lm_logits(x_sbh, self.weight, self.sequence_parallel)  # [b, s, v/tp]


def build_output_layer(config: GPTConfig) -> OutputLayer:
    """The untied output projection (vocab-parallel rows, no bias)."""
    layer = OutputLayer(
        config.arch.hidden,
        config.vocab,
        name="output_layer",
        init_fn=config.init_fn(),
        seed=config.seed,
        bias=False,
        sequence_parallel=config.sequence_parallel,
        params_dtype=config.params_dtype,
    )
    layer.mup_output_mult = output_mult(config)
    return layer


def build_final_norm(config: GPTConfig) -> nn.Module:
    norm = build_norm(config.norm_settings)
    if config.sequence_parallel:
        mark_partial_over_tensor_parallel(norm.parameters())  # it sees a sequence shard
    return norm


class ValueHead(nn.Module):
    """hidden `[s, b, h]` -> one scalar per token `[b, s, 1]`, the same on every tp rank."""

    def __init__(self, config: GPTConfig, name: str = "value_head") -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(1, config.arch.hidden, dtype=config.params_dtype))
        initialize_param_(self.weight, f"{name}.weight", config.seed, config.init_fn(), (1, config.arch.hidden))
        set_tensor_model_parallel_attributes(self.weight, False)
        self.sequence_parallel = config.sequence_parallel and get_tensor_model_parallel_world_size() > 1
        if self.sequence_parallel:
            mark_partial_over_tensor_parallel([self.weight])  # it sees a sequence shard

    def forward(self, x_sbh: torch.Tensor) -> torch.Tensor:
        values_sb1 = F.linear(x_sbh, self.weight)  # [s, b, 1] (or this rank's sequence shard)
        if self.sequence_parallel:
            values_sb1 = gather_from_sequence_parallel_region(values_sb1, grad_is_partial=False)
        return values_sb1.transpose(0, 1).contiguous()  # [b, s, 1]


class GPTModel(nn.Module):
    """tokens `[b, s]` -> logits `[b, s, padded_vocab_size / tp]` (this rank's vocabulary shard),
    or with `value_head` one scalar per token `[b, s, 1]`.

    Parameter names are the canonical names that seed their initialisation, so the same name
    means the same full weight in every parallel layout.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        config.check_tensor_parallel(get_tensor_model_parallel_world_size())
        self.sequence_parallel = config.sequence_parallel and get_tensor_model_parallel_world_size() > 1
        self.embedding = GPTEmbedding(config)
        # num_unique_layers: a block that several positions share is one module, listed at each of them
        owners = sharing_owners(config.arch.layers, config.num_unique_layers, config.param_sharing_style)
        built: dict[int, nn.Module] = {}
        for owner in owners:
            if owner not in built:
                built[owner] = build_block(config, owner)
        self.layers = nn.ModuleList(built[owner] for owner in owners)
        self.shared_layers = len(built) < len(owners)
        prompt = SoftPromptSettings.of(config.soft_prompt_tuning)
        self.soft_prompt = None if prompt is None else SoftPrompt(prompt, config.arch.hidden, config.seed,
                                                                 config.params_dtype)
        self.final_norm = build_final_norm(config)
        untied = config.no_weight_tying and not config.value_head
        self.output_layer = build_output_layer(config) if untied else None
        self.value_head = ValueHead(config) if config.value_head else None

    def output_weight(self) -> torch.Tensor:
        """`[v/tp, h]`: the token embedding itself unless the weights are untied."""
        if self.output_layer is not None:
            return self.output_layer.weight
        return self.embedding.word_embeddings.weight

    def forward(
        self,
        tokens: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`document_ids`: optional `[b, s]` document of each token of a packed sample; a token
        attends only within its document (`megatron/model/documents.py`). `attention_mask`: optional bool, broadcastable to `[b, 1, s, s]` (`[b, 1, s, seen + s]`
        with a cache), True = may attend, combined with the causal mask. `position_ids`: optional
        `[b, s]`, default 0..s-1 (seen..seen+s-1 with a cache). `kv_cache`: for incremental decoding,
        the tokens are appended after the ones already in it."""
        if kv_cache is not None:
            if self.sequence_parallel:
                raise ModelConfigError("incremental decoding with a kv_cache does not support sequence parallelism")
            if position_ids is None:
                position_ids = torch.arange(kv_cache.seen, kv_cache.seen + tokens.shape[1], device=tokens.device)
                position_ids = position_ids.unsqueeze(0)  # [1, s]
        x = self.embedding(tokens, position_ids)  # [s, b, h]
        if self.soft_prompt is not None:
            if kv_cache is not None or attention_mask is not None or document_ids is not None or self.sequence_parallel:
                raise ModelConfigError("a soft prompt (soft_prompt_tuning) runs whole-sequence training and "
                                       "evaluation forwards only")
            x, position_ids = self.soft_prompt.prepend(x, position_ids)  # [n + s, b, h]
        for position, layer in enumerate(self.layers):
            if kv_cache is not None:
                cache = kv_cache.at(position) if self.shared_layers else kv_cache
                x = layer(x, position_ids, attention_mask, cache)  # [s, b, h]
            elif document_ids is not None:
                x = layer(x, position_ids, attention_mask, None, document_ids)  # [s, b, h]
            else:
                x = layer(x, position_ids, attention_mask)  # [s, b, h]
        if kv_cache is not None:
            kv_cache.seen += tokens.shape[1]
        if self.soft_prompt is not None:
            x = self.soft_prompt.drop(x)  # [s, b, h]
        x = self.final_norm(x)
        if self.value_head is not None:
            return self.value_head(x)  # [b, s, 1]
        cap = self.config.final_logit_softcapping  # Gemma 2: c * tanh(logits / c), elementwise on the vocab shard
        if self.output_layer is not None:
            return soft_cap(self.output_layer(x), cap)  # [b, s, v/tp]
        x = mup_scaled_input(x, self.embedding.mup_output_mult)  # muP's output multiplier (tied head)
        return soft_cap(parallel_lm_logits(x, self.output_weight(), self.sequence_parallel), cap)  # [b, s, v/tp]
