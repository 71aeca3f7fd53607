"""GPT-2's options that Levanter's gpt2 model exposes, against transformers' GPT-2 as the reference:
``scale_attn_by_inverse_layer_idx`` (block i divides its attention scores by i + 1 too) and the
tanh-approximated GELU (``gelu_new``, our ``activation: gelu_tanh``)."""

from __future__ import annotations

import pytest
import torch

from megatron.model.attention import SelfAttention
from megatron.model.config import GPTConfig

HIDDEN, HEADS, SEQ = 32, 4, 8


def gpt2_attention(layer: int, scale_by_layer: bool) -> torch.nn.Module:
    from transformers import GPT2Config
    from transformers.models.gpt2.modeling_gpt2 import GPT2Attention

    config = GPT2Config(n_embd=HIDDEN, n_head=HEADS, n_positions=SEQ, attn_pdrop=0.0, resid_pdrop=0.0,
                        scale_attn_by_inverse_layer_idx=scale_by_layer)
    config._attn_implementation = "eager"  # the reference: transformers' own explicit softmax(QK^T)
    return GPT2Attention(config, layer_idx=layer).eval()


def ours(layer: int, scale_by_layer: bool, reference: torch.nn.Module) -> SelfAttention:
    config = GPTConfig(num_layers=4, hidden_size=HIDDEN, num_attention_heads=HEADS, seq_length=SEQ,
                       padded_vocab_size=16, pos_emb="none", scale_attn_by_inverse_layer_idx=scale_by_layer)
    attention = SelfAttention(config, "layers.attention", layer_number=layer).eval()
    with torch.no_grad():  # GPT-2's Conv1D stores [in, out]; our linears store [out, in]; q|k|v alike
        attention.query_key_value.weight.copy_(reference.c_attn.weight.T)
        attention.query_key_value.bias.copy_(reference.c_attn.bias)
        attention.dense.weight.copy_(reference.c_proj.weight.T)
        attention.dense.bias.copy_(reference.c_proj.bias)
    return attention


def causal_mask() -> torch.Tensor:
    """The additive causal mask transformers' GPT2Model would hand its attention blocks."""
    blocked = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1)
    return torch.zeros(1, 1, SEQ, SEQ).masked_fill(blocked, torch.finfo(torch.float32).min)


@pytest.mark.parametrize("layer", [0, 1, 3])
@pytest.mark.parametrize("scale_by_layer", [True, False])
def test_attention_equals_transformers_gpt2(layer: int, scale_by_layer: bool) -> None:
    torch.manual_seed(layer)
    reference = gpt2_attention(layer, scale_by_layer)
    x_bsh = torch.randn(2, SEQ, HIDDEN)
    with torch.no_grad():
        expected = reference(x_bsh, attention_mask=causal_mask())[0]  # [b, s, h]
        got = ours(layer, scale_by_layer, reference)(x_bsh.transpose(0, 1)).transpose(0, 1)  # ours is [s, b, h]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_the_option_changes_deeper_blocks_only() -> None:
    torch.manual_seed(0)
    x_sbh = 10 * torch.randn(SEQ, 2, HIDDEN)  # scores large enough that dividing them shows
    outputs = {}
    for layer in (0, 2):
        reference = gpt2_attention(layer, True)
        with torch.no_grad():
            outputs[layer] = [ours(layer, flag, reference)(x_sbh) for flag in (False, True)]
    torch.testing.assert_close(outputs[0][0], outputs[0][1])  # block 0 divides by 1
    assert (outputs[2][0] - outputs[2][1]).abs().max() > 1e-3  # block 2 divides by 3 (100x the parity tolerance)


def test_gelu_tanh_is_transformers_gelu_new() -> None:
    from transformers.activations import ACT2FN

    from megatron.model.activations import get_activation

    x = torch.linspace(-6, 6, 1001)
    torch.testing.assert_close(get_activation("gelu_tanh").fn(x), ACT2FN["gelu_new"](x), atol=1e-6, rtol=1e-6)
    assert (get_activation("gelu").fn(x) - ACT2FN["gelu_new"](x)).abs().max() > 1e-4  # exact GELU differs
