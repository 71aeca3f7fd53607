"""The GPT model as DeepSpeed pipeline layers.

`pipeline_layer_specs(config)` lists the same modules as `GPTModel` (same classes, same
canonical init names, hence the same initial weights) for `deepspeed.pipe.PipelineModule`:

    embedding (tied "embed") | layer 0 ... layer L-1 | final norm | output (tied "embed" or own)

Between stages the activation is the hidden state `[s, b, h]`, or the tuple
`(hidden, position_ids[, document_ids])` when the batch's inputs were `(tokens, position_ids[,
document_ids])` (packed samples whose documents do not see each other, `megatron/model/documents.py`). The last stage returns logits `[b, s, v/tp]` (with a value head: `[b, s, 1]`) for
the objective's `loss_fn(output, labels)` (`megatron/objectives`).
"""

from __future__ import annotations

import torch
from deepspeed.pipe import LayerSpec, TiedLayerSpec
from torch import nn

from megatron.model.block import Block
from megatron.model.blocks import block_family
from megatron.model.config import GPTConfig, ModelConfigError
from megatron.model.embedding import GPTEmbedding
from megatron.model.family_config import FAMILIES
from megatron.model.gmlp import GMLPBlock
from megatron.model.gpt import ValueHead, build_final_norm, build_output_layer
from megatron.model.layer_sharing import shared_owners, sharing_owners
from megatron.model.soft_prompt import SoftPrompt
from megatron.model.soft_prompt_settings import PROMPT_NAME, SoftPromptSettings
from megatron.model.mamba import MambaLayer
from megatron.model.mup import mup_scaled_input
from megatron.model.rwkv import RWKVLayer
from megatron.model.transformer_layer import TransformerLayer
from megatron.model.softcap import soft_cap
from megatron.mpu.layers import parallel_lm_logits
from megatron.mpu.topology import get_tensor_model_parallel_world_size

__all__ = [
    "BLOCK_PARTITION",
    "CHECKPOINTABLE_LAYERS",
    "EmbeddingPipe",
    "FinalNormPipe",
    "OutputLayerPipe",
    "TransformerLayerPipe",
    "ValueHeadPipe",
    "model_parameter_name",
    "pipeline_layer_specs",
]

TIED_EMBEDDING_KEY = "embed"
TIED_WEIGHT_ATTR = "word_embeddings.weight"
SHARED_BLOCK_PREFIX = "shared_block_"

Activation = torch.Tensor | tuple[torch.Tensor, ...]


def _split(inputs: Activation) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    if isinstance(inputs, torch.Tensor):
        return inputs, ()
    return inputs[0], tuple(inputs[1:])


def _join(x: torch.Tensor, extra: tuple[torch.Tensor, ...]) -> Activation:
    return (x, *extra) if extra else x


class EmbeddingPipe(GPTEmbedding):
    """tokens `[b, s]` or `(tokens, position_ids[, document_ids])` -> hidden (+ the extras); with a soft prompt
    (``soft_prompt_tuning``, one stage) the prompt then the hidden states, and the blocks' positions."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__(config)
        prompt = SoftPromptSettings.of(config.soft_prompt_tuning)
        self.soft_prompt = None if prompt is None else SoftPrompt(prompt, config.arch.hidden, config.seed,
                                                                 config.params_dtype)

    def forward(self, inputs: Activation) -> Activation:  # type: ignore[override]  # a pipeline stage's one input
        tokens, extra = _split(inputs)
        position_ids = extra[0] if extra else None
        x = super().forward(tokens, position_ids)  # [s, b, h]
        if self.soft_prompt is None:
            return _join(x, extra)
        if len(extra) > 1:
            raise ModelConfigError("a soft prompt (soft_prompt_tuning) does not run with document masks")
        x, position_ids = self.soft_prompt.prepend(x, position_ids)  # [n + s, b, h]
        return _join(x, () if position_ids is None else (position_ids,))



def _block_pipe_forward(block: Block, inputs: Activation) -> Activation:
    x, extra = _split(inputs)
    position_ids = extra[0] if len(extra) > 0 else None
    document_ids = extra[1] if len(extra) > 1 else None
    return _join(block.block_forward(x, position_ids, None, None, document_ids), extra)


class TransformerLayerPipe(TransformerLayer):
    block_forward = TransformerLayer.forward  # type: ignore[assignment]  # Block declares the shared signature

    def forward(self, inputs: Activation) -> Activation:  # type: ignore[override]  # a pipeline stage's one input
        return _block_pipe_forward(self, inputs)


class MambaLayerPipe(MambaLayer):
    block_forward = MambaLayer.forward  # type: ignore[assignment]  # Block declares the shared signature

    def forward(self, inputs: Activation) -> Activation:  # type: ignore[override]  # a pipeline stage's one input
        return _block_pipe_forward(self, inputs)


class RWKVLayerPipe(RWKVLayer):
    block_forward = RWKVLayer.forward  # type: ignore[assignment]  # Block declares the shared signature

    def forward(self, inputs: Activation) -> Activation:  # type: ignore[override]  # a pipeline stage's one input
        return _block_pipe_forward(self, inputs)


class GMLPBlockPipe(GMLPBlock):
    block_forward = GMLPBlock.forward  # type: ignore[assignment]  # Block declares the shared signature

    def forward(self, inputs: Activation) -> Activation:  # type: ignore[override]  # a pipeline stage's one input
        return _block_pipe_forward(self, inputs)


FAMILIES.attach("transformer", pipe_block=TransformerLayerPipe)
FAMILIES.attach("mamba", pipe_block=MambaLayerPipe)
FAMILIES.attach("rwkv", pipe_block=RWKVLayerPipe)
FAMILIES.attach("gmlp", pipe_block=GMLPBlockPipe)

CHECKPOINTABLE_LAYERS = [entry.pipe_class().__name__ for _, entry in FAMILIES.items()]
"""Every family's pipeline layer (its registry entry's ``pipe_block``), and only blocks: a chunk that starts at
the embedding has integer inputs only, so DeepSpeed's (reentrant) checkpoint would return an output that does
not require grad."""
BLOCK_PARTITION = "type:" + "|".join(f"^{name}$" for name in CHECKPOINTABLE_LAYERS)
"""DeepSpeed's ``partition_method`` that balances the blocks (of every family) over the stages."""


class FinalNormPipe(nn.Module):
    """The final norm; drops the extras, so the head sees the hidden state only."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.final_norm = build_final_norm(config)
        prompt = SoftPromptSettings.of(config.soft_prompt_tuning)
        self.prompt_tokens = 0 if prompt is None else prompt.n_tokens  # the soft prompt's outputs are dropped here

    def forward(self, inputs: Activation) -> torch.Tensor:
        x, _ = _split(inputs)
        return self.final_norm(x[self.prompt_tokens :])


class OutputLayerPipe(nn.Module):
    """Untied output projection: hidden `[s, b, h]` -> logits `[b, s, v/tp]`."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.output_layer = build_output_layer(config)
        self.final_logit_softcapping = config.final_logit_softcapping

    def forward(self, x_sbh: torch.Tensor) -> torch.Tensor:
        return soft_cap(self.output_layer(x_sbh), self.final_logit_softcapping)  # [b, s, v/tp]


class ValueHeadPipe(nn.Module):
    """Reward-model head: hidden `[s, b, h]` -> values `[b, s, 1]`."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.value_head = ValueHead(config)

    def forward(self, x_sbh: torch.Tensor) -> torch.Tensor:
        return self.value_head(x_sbh)


class SharedBlockSpec(TiedLayerSpec):
    """A block that several positions share (``num_unique_layers``): one module per stage for all its positions
    there, every one of its parameters tied across the stages that hold it (DeepSpeed broadcasts them from the
    first such stage at construction and all-reduces their gradients every step: the sum over positions)."""

    def build(self, log: bool = False) -> nn.Module:
        module = super().build(log)
        self.tied_weight_attr = [name for name, _ in module.named_parameters()]  # read by PipelineModule after build
        return module


def shared_block_key(owner: int) -> str:
    """``tied_modules`` key of the block first used at position ``owner``."""
    return f"{SHARED_BLOCK_PREFIX}{owner}"


def tied_embedding_logits(embedding: EmbeddingPipe, x_sbh: torch.Tensor) -> torch.Tensor:
    """The tied head on the last stage: logits from the (synchronised) token embedding."""
    x_sbh = mup_scaled_input(x_sbh, embedding.mup_output_mult)  # muP's output multiplier
    logits = parallel_lm_logits(x_sbh, embedding.word_embeddings.weight, embedding.sequence_parallel)
    return soft_cap(logits, embedding.final_logit_softcapping)  # [b, s, v/tp]


_BLOCK_PREFIXES = ("input_layernorm.", "attention.", "post_attention_layernorm.", "mlp.",  # transformer
                   "attention_output_norm.", "mlp_output_norm.",  # transformer, norm_placement post/sandwich
                   "norm.", "mixer.",  # Mamba
                   "ln1.", "ln2.", "att.", "ffn.",  # RWKV
                   "input_linear.", "sgu.", "output_linear.")  # gMLP
_EMBEDDING_PREFIXES = ("word_embeddings.", "position_embeddings.")


def model_parameter_name(pipeline_name: str) -> str:
    """`GPTModel`'s name for a `PipelineModule` parameter (for checkpoint conversion between layouts).

    PipelineModule names a layer by its spec index: `4.mlp.dense_h_to_4h.weight` is block 3
    (spec 0 is the embedding) -> `layers.3.mlp.dense_h_to_4h.weight`; the tied embedding lives under
    `tied_modules.embed.` -> `embedding.`; the final norm and heads keep their own names.
    """
    tied_prefix = f"tied_modules.{TIED_EMBEDDING_KEY}."
    if pipeline_name.startswith(f"{tied_prefix}{PROMPT_NAME}."):  # the soft prompt lives in the embedding stage
        return pipeline_name[len(tied_prefix) :]
    if pipeline_name.startswith(tied_prefix):
        return "embedding." + pipeline_name[len(tied_prefix) :]
    if pipeline_name.startswith(f"tied_modules.{SHARED_BLOCK_PREFIX}"):  # a shared block: its owner's names
        key, rest = pipeline_name.removeprefix("tied_modules.").split(".", 1)
        return f"layers.{int(key.removeprefix(SHARED_BLOCK_PREFIX))}.{rest}"
    index, rest = pipeline_name.split(".", 1)
    if rest.startswith(_BLOCK_PREFIXES):
        return f"layers.{int(index) - 1}.{rest}"
    if rest.startswith(_EMBEDDING_PREFIXES):
        return f"embedding.{rest}"
    return rest  # final_norm.*, output_layer.*, value_head.*


def pipeline_location(name: str, num_layers: int) -> tuple[int, str]:
    """(layer spec index, name inside that layer) of a `GPTModel` parameter, for the specs
    `pipeline_layer_specs` builds: the inverse of `model_parameter_name` up to the tied prefix."""
    if name.startswith("embedding."):
        return 0, name.removeprefix("embedding.")
    if name.startswith(f"{PROMPT_NAME}."):  # the soft prompt lives in the embedding stage
        return 0, name
    if name.startswith("layers."):
        _, index, rest = name.split(".", 2)
        return int(index) + 1, rest
    if name.startswith("final_norm."):
        return num_layers + 1, name
    if name.startswith(("output_layer.", "value_head.")):
        return num_layers + 2, name
    raise ValueError(f"parameter {name!r} has no place in the pipeline layers")


def pipeline_parameter_name(name: str, num_layers: int, tied: bool, shared: frozenset[int] = frozenset()) -> str:
    """`PipelineModule`'s name for a `GPTModel` parameter (the inverse of `model_parameter_name`);
    `tied`: the embedding is shared with the output layer, so it lives under `tied_modules`; `shared`: the
    owners of shared blocks (`layer_sharing.shared_owners`), each a tied module too (`SharedBlockSpec`)."""
    index, local = pipeline_location(name, num_layers)
    if tied and index == 0:
        return f"tied_modules.{TIED_EMBEDDING_KEY}.{local}"
    if name.startswith("layers.") and index - 1 in shared:
        return f"tied_modules.{shared_block_key(index - 1)}.{local}"
    return f"{index}.{local}"


def pipeline_file_name(pipeline_name: str) -> str:
    """The name (`<spec index>.<name>`) a `PipelineModule` parameter has in the per-layer checkpoint files: a tied
    module is in the file of every layer holding it, the embedding in spec 0's, a shared block in its owner's."""
    if not pipeline_name.startswith("tied_modules."):
        return pipeline_name
    key, rest = pipeline_name.removeprefix("tied_modules.").split(".", 1)
    if key.startswith(SHARED_BLOCK_PREFIX):
        return f"{int(key.removeprefix(SHARED_BLOCK_PREFIX)) + 1}.{rest}"
    return f"0.{rest}"


def is_pipeline_parameter_name(name: str) -> bool:
    """Whether `name` is a `PipelineModule` name (spec index or tied module) rather than a `GPTModel` one."""
    return name.split(".", 1)[0].isdigit() or name.startswith("tied_modules.")


def pipeline_layer_specs(config: GPTConfig) -> list[LayerSpec]:
    """Specs for `PipelineModule(layers=..., loss_fn=..., partition_method=BLOCK_PARTITION,
    checkpointable_layers=CHECKPOINTABLE_LAYERS)`."""
    config.check_tensor_parallel(get_tensor_model_parallel_world_size())
    tied = not config.no_weight_tying and not config.value_head
    first: LayerSpec
    last: LayerSpec
    if config.value_head:
        first, last = LayerSpec(EmbeddingPipe, config), LayerSpec(ValueHeadPipe, config)
    elif tied:
        first = TiedLayerSpec(TIED_EMBEDDING_KEY, EmbeddingPipe, config, tied_weight_attr=TIED_WEIGHT_ATTR)
        last = TiedLayerSpec(
            TIED_EMBEDDING_KEY,
            EmbeddingPipe,
            config,
            forward_fn=tied_embedding_logits,
            tied_weight_attr=TIED_WEIGHT_ATTR,
        )
    else:
        first, last = LayerSpec(EmbeddingPipe, config), LayerSpec(OutputLayerPipe, config)
    owners = sharing_owners(config.arch.layers, config.num_unique_layers, config.param_sharing_style)
    shared = shared_owners(config.arch.layers, config.num_unique_layers, config.param_sharing_style)
    layers = [SharedBlockSpec(shared_block_key(owner), FAMILIES[block_family(config, owner)].pipe_class(), config, owner)
              if owner in shared else LayerSpec(FAMILIES[block_family(config, i)].pipe_class(), config, i)
              for i, owner in enumerate(owners)]
    return [first, *layers, LayerSpec(FinalNormPipe, config), last]
