"""Transformer Engine layers (NVIDIA GPU only): the ``te_*`` keys, as GPT-NeoX ea7aefd8 builds them
(megatron/model/transformer_engine.py, transformer.py:962-1062, utils.py:415-428).

Deepy builds its own model first (every weight drawn from its canonical name, so the same in every layout),
then swaps modules for Transformer Engine's from outside, copying those weights in:

* ``te_columnparallel`` / ``te_rowparallel``: each block's column-parallel (QKV, MLP input) / row-parallel
  (attention output, MLP output) linear becomes ``te.pytorch.Linear`` with ``parallel_mode`` column / row.
  The parameters keep their names (``weight``, ``bias``). GPT-NeoX also swaps its untied output layer;
  Deepy's output layer feeds the vocabulary-parallel loss and stays its own.
* ``te_layernorm_mlp``: a dense block's post-attention norm and MLP become one ``te.pytorch.LayerNormMLP``
  (GPT-NeoX's norm kinds and epsilons: LayerNorm 1e-5, RMSNorm 1e-8, whatever the epsilon keys say; the MLP
  then gets the un-normalised residual, also in a GPT-J block). MoE blocks keep their norm and experts
  (GPT-NeoX drops their norm: its MoE layer then sees un-normalised input).
* ``te_mha`` (or ``te_fp8_mha``): each block's attention becomes ``te.pytorch.MultiheadAttention`` (fused
  QKV as Deepy's ``[q; k; v]``, causal, sliding window, rotary); GPT-NeoX passes ``window_size`` an int,
  which Transformer Engine wants as a ``(left, right)`` pair: Deepy passes ``(window, 0)``.
* ``te_fp8_mha``: each block runs under ``fp8_autocast`` with a ``DelayedScaling`` recipe from the
  ``te_fp8_*`` keys (:func:`fp8_recipe_arguments`). GPT-NeoX's ``TEDelayedScaling`` never ran: it reads
  ``neox_args.fp8_margin`` (no such key: ``te_fp8_margin`` is meant), passes ``fp8_format=te_fp8_format``
  (an undefined name) and calls a ``get_context`` it does not define.

The pure parts (which modules are swapped, the recipe's arguments, the norm kind) are tested on the CPU
(tests/unit/test_gpu_libraries.py); the swaps need the library and a GPU (tests/gpu/test_transformer_engine.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from megatron.model.checks import TE_MLP_ACTIVATIONS, TE_NORMS
from megatron.model.config import GPTConfig, ModelConfigError
from megatron.model.transformer_layer import TransformerLayer
from megatron.mpu.layers import ColumnParallelLinear, RowParallelLinear
from megatron.mpu.topology import get_tensor_model_parallel_group, get_tensor_model_parallel_world_size



@dataclass(frozen=True, slots=True)
class TESwaps:
    """Which of a block's modules become Transformer Engine's."""

    column_linears: bool
    row_linears: bool
    layernorm_mlp: bool
    attention: bool
    fp8: bool

    @property
    def any(self) -> bool:
        return self.column_linears or self.row_linears or self.layernorm_mlp or self.attention or self.fp8


def te_swaps(cfg: GPTConfig) -> TESwaps:
    """GPT-NeoX's choices: ``te_fp8_mha`` builds TE attention too (transformer.py:962)."""
    return TESwaps(column_linears=cfg.te_columnparallel, row_linears=cfg.te_rowparallel,
                   layernorm_mlp=cfg.te_layernorm_mlp, attention=cfg.te_mha or cfg.te_fp8_mha, fp8=cfg.te_fp8_mha)


def te_normalization(norm: str) -> tuple[str, float]:
    """Transformer Engine's ``normalization`` and the epsilon GPT-NeoX's TELayerNormMLP / TEMultiheadAttention
    give it for ``norm`` (hard-coded there, not the epsilon keys)."""
    if norm in TE_NORMS[:2]:
        return "LayerNorm", 1.0e-5
    if norm in TE_NORMS[2:]:
        return "RMSNorm", 1.0e-8
    raise ModelConfigError(f"te_layernorm_mlp fuses a LayerNorm or RMSNorm: norm={norm!r} has neither; "
                           f"set norm: layernorm, rmsnorm, te_layernorm or te_rmsnorm")


def fp8_recipe_arguments(cfg: GPTConfig) -> dict[str, Any]:
    """Keyword arguments of ``transformer_engine.common.recipe.DelayedScaling`` (``fp8_format`` by the name
    of its ``Format`` member), as GPT-NeoX's TEDelayedScaling means them."""
    return {
        "margin": cfg.te_fp8_margin,
        "fp8_format": {"e4m3": "E4M3", "hybrid": "HYBRID"}[cfg.te_fp8_format],
        "amax_compute_algo": cfg.te_fp8_amax_compute_algo,
        "amax_history_len": cfg.te_fp8_amax_history_len,
        "override_linear_precision": (False, False, not cfg.te_fp8_wgrad),
        "fp8_mha": cfg.te_fp8_mha,
    }


# --- the swaps (need Transformer Engine and a GPU) ----------------------------------------------------------
def apply_transformer_engine(model: nn.Module, cfg: GPTConfig) -> None:
    """Swap every transformer block's modules in ``model`` for Transformer Engine's, as ``cfg`` says."""
    swaps = te_swaps(cfg)
    if not swaps.any:
        return
    # lazy: CUDA-only library (requirements/requirements-kernels.txt); refused before launch where missing
    import transformer_engine.pytorch as te

    tp = get_tensor_model_parallel_world_size()
    parallel = {"tp_group": get_tensor_model_parallel_group() if tp > 1 else None, "tp_size": tp,
                "sequence_parallel": cfg.sequence_parallel and tp > 1, "params_dtype": cfg.params_dtype}
    for layer in [m for m in model.modules() if isinstance(m, TransformerLayer)]:
        if swaps.attention:
            # assignment: TEAttention is called as SelfAttention is, the type the block declares
            layer.attention = TEAttention(te, layer.attention, cfg, layer.layer_number, parallel)  # type: ignore[assignment]  # same call
        if swaps.layernorm_mlp and not cfg.is_moe_layer(layer.layer_number):
            norm = layer.post_attention_layernorm or layer.input_layernorm
            layer.mlp = _te_layernorm_mlp(te, norm, layer.mlp, cfg, parallel)
            # the fused module normalises itself: the MLP gets the residual stream as it is
            layer.post_attention_layernorm = nn.Identity()
        for parent, name, child in list(_children(layer)):
            if swaps.column_linears and type(child) is ColumnParallelLinear and not child.gather_output:
                setattr(parent, name, _te_linear(te, child, "column", parallel))
            elif swaps.row_linears and type(child) is RowParallelLinear and child.input_is_parallel:
                setattr(parent, name, _te_linear(te, child, "row", parallel))
        if swaps.fp8:
            _run_under_fp8(te, layer, cfg, parallel["tp_group"])


def _children(module: nn.Module) -> Iterator[tuple[nn.Module, str, nn.Module]]:
    for parent in module.modules():
        for name, child in parent.named_children():
            yield parent, name, child


def _copy_param(target: torch.Tensor, source: torch.Tensor | None) -> None:
    """``target`` takes ``source``'s values (zeros where Deepy's layer has no such parameter) and Deepy's
    tensor-parallel markers (the gradient clipping and checkpoint shards read them)."""
    with torch.no_grad():
        if source is None:
            target.zero_()
        else:
            target.copy_(source.reshape(target.shape))
            target.__dict__.update(getattr(source, "__dict__", {}))


def _copy_rows(targets: list[torch.Tensor], source: torch.Tensor | None) -> None:
    """Consecutive row blocks of ``source`` into ``targets`` (TE's q, k, v parameters)."""
    start = 0
    for target in targets:
        rows = target.shape[0]
        _copy_param(target, None if source is None else source[start:start + rows])
        start += rows


def _te_linear(te: Any, old: ColumnParallelLinear | RowParallelLinear, mode: str, parallel: dict[str, Any]) -> Any:
    """Transformer Engine's Linear with ``old``'s full sizes, split as ``mode`` says, holding ``old``'s shard."""
    new = te.Linear(old.input_size, old.output_size, bias=old.bias is not None, parallel_mode=mode, device="cuda",
                    **parallel)
    _copy_param(new.weight, old.weight)
    if old.bias is not None:
        _copy_param(new.bias, old.bias)
    return new


def _te_layernorm_mlp(te: Any, norm: Any, mlp: Any, cfg: GPTConfig, parallel: dict[str, Any]) -> Any:
    """The fused norm + MLP holding Deepy's norm and MLP weights."""
    if cfg.activation not in TE_MLP_ACTIVATIONS:  # refused before launch too (model/checks.py)
        raise ModelConfigError(f"te_layernorm_mlp computes the activations {', '.join(TE_MLP_ACTIVATIONS)}; "
                               f"activation={cfg.activation!r} is not one of them")
    normalization, eps = te_normalization(cfg.norm)
    new = te.LayerNormMLP(cfg.arch.hidden, cfg.mlp_widths.second, eps=eps, bias=cfg.use_bias_in_mlp,
                          normalization=normalization, activation=cfg.activation,
                          set_parallel_mode=parallel["tp_size"] > 1, device="cuda", **parallel)
    _copy_param(new.layer_norm_weight, norm.weight)
    if normalization == "LayerNorm":
        _copy_param(new.layer_norm_bias, getattr(norm, "bias", None))
    _copy_param(new.fc1_weight, mlp.dense_h_to_4h.weight)  # Deepy's [gate; up]: TE's gated order
    _copy_param(new.fc2_weight, mlp.dense_4h_to_h.weight)
    if cfg.use_bias_in_mlp:
        _copy_param(new.fc1_bias, mlp.dense_h_to_4h.bias)
        _copy_param(new.fc2_bias, mlp.dense_4h_to_h.bias)
    return new


class TEAttention(nn.Module):
    """Deepy's attention call (hidden states, positions, mask, KV cache, documents) on Transformer Engine's
    MultiheadAttention, which holds Deepy's attention weights."""

    def __init__(self, te: Any, old: Any, cfg: GPTConfig, layer_number: int, parallel: dict[str, Any]) -> None:
        super().__init__()
        window = cfg.attention_window(layer_number)
        # unused with input_layernorm=False (the block's own norm runs first), given as GPT-NeoX gives it
        normalization, eps = te_normalization(cfg.norm) if cfg.norm in TE_NORMS else ("LayerNorm", 1.0e-5)
        self.attention: Any = te.MultiheadAttention(
            cfg.arch.hidden, cfg.arch.heads, kv_channels=cfg.head_dim, attention_dropout=cfg.attention_dropout,
            layernorm_epsilon=eps, layer_number=layer_number + 1, attn_mask_type="causal",
            window_size=None if window is None else (window, 0),
            num_gqa_groups=None if cfg.kv_heads == cfg.arch.heads else cfg.kv_heads, input_layernorm=False,
            normalization=normalization, bias=True, set_parallel_mode=parallel["tp_size"] > 1, return_bias=False,
            qkv_format="sbhd", fuse_qkv_params=True, qkv_weight_interleaved=False, device="cuda", **parallel)
        # Deepy's fused QKV is [q_r; k_r; v_r] on this rank: TE's (not interleaved) holds the same rows in order
        qkv = self.attention.qkv
        _copy_rows([p for n, p in qkv.named_parameters() if n.endswith("weight")], old.query_key_value.weight)
        _copy_rows([p for n, p in qkv.named_parameters() if n.endswith("bias")], old.query_key_value.bias)
        _copy_param(self.attention.proj.weight, old.dense.weight)
        _copy_param(self.attention.proj.bias, old.dense.bias)
        self.rotary = (te.attention.RotaryPositionEmbedding(cfg.rotary_dim, rotary_base=cfg.rotary_emb_base)
                       if cfg.pos_emb == "rotary" else None)
        self.sequence_parallel, self.tp = bool(parallel["sequence_parallel"]), int(parallel["tp_size"])

    def forward(self, x_sbh: torch.Tensor, position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, kv_cache: Any = None,
                document_ids: torch.Tensor | None = None) -> torch.Tensor:
        if kv_cache is not None or document_ids is not None:
            raise NotImplementedError("te_mha runs training's causal attention: no KV cache, no per-document "
                                      "masks (generation and reset_attention_mask use Deepy's attention)")
        seq = x_sbh.shape[0] * (self.tp if self.sequence_parallel else 1)
        rope = None if self.rotary is None else self.rotary(seq)
        out: torch.Tensor = self.attention(x_sbh, rotary_pos_emb=rope)  # [s, b, h]
        return out


def _run_under_fp8(te: Any, layer: nn.Module, cfg: GPTConfig, group: Any) -> None:
    """``layer``'s forward runs under ``fp8_autocast`` with the te_fp8_* recipe (GPT-NeoX: each block's)."""
    # lazy: CUDA-only library (requirements/requirements-kernels.txt)
    from transformer_engine.common import recipe

    arguments = fp8_recipe_arguments(cfg)
    arguments["fp8_format"] = getattr(recipe.Format, arguments["fp8_format"])
    fp8_recipe = recipe.DelayedScaling(**arguments)
    inner: Callable[..., Any] = layer.forward

    @functools.wraps(inner)
    def forward(*args: Any, **kwargs: Any) -> Any:
        with te.fp8_autocast(enabled=True, fp8_recipe=fp8_recipe, fp8_group=group):
            return inner(*args, **kwargs)

    layer.forward = forward
