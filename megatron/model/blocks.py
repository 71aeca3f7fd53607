"""Which block each layer is: its ``attention_config`` type picks the family (``family_config.family_of``),
whose registry entry (``family_config.FAMILIES``) gets its block class here (the registry imports no torch).

GPT-NeoX builds its layer list the same way (``megatron/model/gpt2_model.py:243-287``, commit ea7aefd8):
``gmlp``/``amlp`` -> ``GMLPBlock``, ``rwkv`` -> ``RWKVResidualLayerPipe``, ``mamba`` ->
``ParallelMambaResidualLayerPipe``, every attention type -> ``ParallelTransformerLayerPipe``.
"""

from __future__ import annotations

from megatron.model.block import Block
from megatron.model.config import GPTConfig
from megatron.model.family_config import FAMILIES, FamilyName, family_of
from megatron.model.gmlp import GMLPBlock
from megatron.model.mamba import MambaLayer
from megatron.model.rwkv import RWKVLayer
from megatron.model.transformer_layer import TransformerLayer

FAMILIES.attach("transformer", block=TransformerLayer)
FAMILIES.attach("mamba", block=MambaLayer)
FAMILIES.attach("rwkv", block=RWKVLayer)
FAMILIES.attach("gmlp", block=GMLPBlock)


def block_family(config: GPTConfig, layer_number: int) -> FamilyName:
    return family_of(config.attention_types[layer_number])


def build_block(config: GPTConfig, layer_number: int) -> Block:
    """Layer ``layer_number`` (0-based) of the stack."""
    block = FAMILIES[block_family(config, layer_number)].build(config, layer_number)
    assert isinstance(block, Block)
    return block
