"""The architecture of a GPT model, as one typed record with GPT-NeoX field names.

`GPTConfig` holds only what changes the network; it is frozen, and the trainer builds it from the
validated arguments with `GPTConfig.from_args(args)` (one explicit read per key). Derived sizes (head
dim, kv heads, MLP width, per-layer attention type) live here as properties so every module computes
them the same way.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

from megatron.errors import ConfigError
from megatron.model.activations import ACTIVATIONS
from megatron.model.norms import NORMS
from megatron.model.rope_scaling import RopeScaling, parse_rope_scaling
from megatron.mpu.initialize_weights import InitFn, init_method_from_name

if TYPE_CHECKING:
    from megatron.neox_arguments.arguments import NeoXArgs

PosEmb = Literal["learned", "rotary", "sinusoidal", "rpe", "alibi", "none"]
InitMethod = Literal[
    "normal",
    "scaled_normal",
    "orthogonal",
    "scaled_orthogonal",
    "xavier_uniform",
    "xavier_normal",
    "wang_init",
    "small_init",
    "single_residual_scaled_normal",
]

_POS_EMB = typing.get_args(PosEmb)
_INIT_METHODS = typing.get_args(InitMethod)

# attention types a layer may have; the kernel choice ("flash") does not change the maths
_GLOBAL_ATTENTION = {"global", "flash"}
_LOCAL_ATTENTION = {"local"}

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


class ModelConfigError(ConfigError, ValueError):
    """An architecture the model cannot build (a ConfigError for the entry points, a ValueError for callers)."""


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Architecture fields of a GPT model. Names and defaults follow GPT-NeoX."""

    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    num_kv_heads: int | None = None
    """Key/value heads for grouped-query (None = one per query head, 1 = multi-query)."""
    seq_length: int = 128
    max_position_embeddings: int | None = None
    """Size of the learned position table; None = seq_length."""
    padded_vocab_size: int = 128
    """Vocabulary rows, padded so that it divides by tp (from the tokenizer: see `with_vocab`)."""

    pos_emb: PosEmb = "learned"
    rotary_pct: float = 1.0
    """Fraction of each head's dimensions that rotary rotates (the rest pass through)."""
    rotary_emb_base: int = 10000
    rope_scaling: RopeScaling | None = None
    """HF-style scaling of the rotary frequencies for longer contexts (`megatron/model/rope_scaling.py`)."""
    rpe_num_buckets: int = 32
    """Relative-distance buckets of the T5-style position bias (pos_emb rpe)."""
    rpe_max_distance: int = 128
    """Distance from which relative positions share the last bucket (pos_emb rpe)."""
    rotary_save_freqs_buffer: bool = False
    """Keep rotary's inverse frequencies in the state dict."""
    opt_pos_emb_offset: int = 0
    """Learned positions look up row position + offset (OPT checkpoints use 2)."""

    norm: str = "layernorm"
    layernorm_epsilon: float = 1.0e-5
    rms_norm_epsilon: float = 1.0e-8
    scalenorm_epsilon: float = 1.0e-8
    use_qk_layernorm: bool = False
    scale_attn_by_inverse_layer_idx: bool = False
    """Divide block i's (0-based) attention scores by i + 1 as well as by sqrt(head dim) (GPT-2's and
    Levanter's option), which keeps deep stacks' attention logits small early in training."""
    use_bias_in_norms: bool = True
    use_bias_in_attn_linear: bool = True
    use_bias_in_mlp: bool = True

    activation: str = "gelu"
    intermediate_size: int | None = None
    """MLP width (before gating); None = expansion_factor * hidden_size."""
    expansion_factor: float | None = None
    """MLP width as a multiple of hidden_size; None = 4."""
    mlp_multiple_of: int = 1
    """Round the MLP width up to a multiple of this."""

    gpt_j_residual: bool = False
    """Parallel residual: x + attn(norm1(x)) + mlp(norm2(x))."""
    gpt_j_tied: bool = False
    """With gpt_j_residual, attention and MLP share one input norm."""
    no_weight_tying: bool = False
    """Untie the output projection from the token embedding."""
    value_head: bool = False
    """Output one scalar per token (reward models, `train_impl: rm`) instead of vocabulary logits."""

    init_method: InitMethod = "normal"
    output_layer_init_method: InitMethod = "scaled_normal"
    init_method_std: float = 0.02

    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    sliding_window_width: int | None = None
    """Each token attends to itself and the previous `sliding_window_width` tokens: in the "local"
    layers of `attention_config` if it has any, else in every layer (Mistral style)."""
    attention_config: list[Any] | None = None
    """Per-layer attention types, GPT-NeoX style ([[["global"], n_layers]]) or already expanded."""
    params_dtype: torch.dtype = torch.float32
    seed: int = 1234
    sequence_parallel: bool = False

    # mixture of experts (megatron/model/moe.py); moe_num_experts == 1 is a dense model
    moe_num_experts: int = 1
    moe_expert_interval: int = 1
    """Blocks whose index is a multiple of this get an MoE layer instead of the MLP."""
    moe_top_k: int = 1
    moe_router_type: Literal["sinkhorn", "topk"] = "sinkhorn"
    moe_lbl_in_fp32: bool = False
    moe_jitter_eps: float | None = None
    moe_aux_loss_coeff: float = 0.0
    moe_z_loss_coeff: float = 0.0

    # ------------------------------------------------------------------------------------
    def __post_init__(self) -> None:
        # normalised once here; the dataclass is frozen, so through object.__setattr__
        if isinstance(self.params_dtype, str):
            object.__setattr__(self, "params_dtype", _DTYPES[self.params_dtype])
        if self.num_kv_heads is None:
            object.__setattr__(self, "num_kv_heads", self.num_attention_heads)
        if self.max_position_embeddings is None:
            object.__setattr__(self, "max_position_embeddings", self.seq_length)
        if isinstance(self.rope_scaling, dict):  # HF's dict, as the config file and transformers write it
            object.__setattr__(self, "rope_scaling", parse_rope_scaling(self.rope_scaling, self.max_position_embeddings))
        if self.rope_scaling is not None and self.pos_emb != "rotary":
            raise ModelConfigError(f"rope_scaling scales rotary positions; pos_emb is {self.pos_emb!r}")
        if self.hidden_size % self.num_attention_heads != 0:
            raise ModelConfigError(
                f"hidden_size={self.hidden_size} is not divisible by num_attention_heads="
                f"{self.num_attention_heads}"
            )
        if self.num_attention_heads % self.num_kv_heads != 0:
            raise ModelConfigError(
                f"num_attention_heads={self.num_attention_heads} is not divisible by "
                f"num_kv_heads={self.num_kv_heads}"
            )
        self._check_choices()
        bad = [t for t in self.attention_types if t not in _GLOBAL_ATTENTION | _LOCAL_ATTENTION]
        if bad:
            raise ModelConfigError(f"attention types {sorted(set(bad))} are not supported (only global, flash, local)")
        if self.pos_emb == "rpe" and self.rpe_max_distance <= self.rpe_num_buckets // 2:
            raise ModelConfigError(
                f"rpe_max_distance={self.rpe_max_distance} must exceed half of rpe_num_buckets={self.rpe_num_buckets}"
            )
        if "local" in self.attention_types and self.sliding_window_width is None:
            raise ModelConfigError('attention type "local" needs sliding_window_width (the window it attends over)')
        if self.moe_num_experts > 1 and not 1 <= self.moe_top_k <= self.moe_num_experts:
            raise ModelConfigError(f"moe_top_k={self.moe_top_k} must be in [1, moe_num_experts={self.moe_num_experts}]")

    def _check_choices(self) -> None:
        choices: dict[str, tuple[str, list[str]]] = {
            "pos_emb": (self.pos_emb, list(_POS_EMB)),
            "norm": (self.norm, sorted(NORMS)),
            "activation": (self.activation, sorted(ACTIVATIONS)),
            "init_method": (self.init_method, list(_INIT_METHODS)),
            "output_layer_init_method": (self.output_layer_init_method, list(_INIT_METHODS)),
        }
        for key, (value, allowed) in choices.items():
            if value not in allowed:
                raise ModelConfigError(f"{key}={value!r} is not supported; choose one of {allowed}")

    # --- derived sizes -------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def kv_heads(self) -> int:
        assert self.num_kv_heads is not None
        return self.num_kv_heads

    @property
    def ffn_hidden_size(self) -> int:
        """MLP width (one half of the first projection for gated activations)."""
        if self.intermediate_size is not None:
            width = self.intermediate_size
        else:
            factor = 4.0 if self.expansion_factor is None else self.expansion_factor
            width = int(factor * self.hidden_size)
        multiple = max(1, self.mlp_multiple_of)
        return multiple * math.ceil(width / multiple)

    def is_moe_layer(self, layer_number: int) -> bool:
        """Whether block `layer_number` (0-based) has an MoE layer instead of the dense MLP (GPT-NeoX's rule)."""
        return self.moe_num_experts > 1 and layer_number % max(1, self.moe_expert_interval) == 0

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_layers))

    @property
    def rotary_dim(self) -> int:
        """Dimensions of each head that rotary rotates (even)."""
        dim = int(self.head_dim * self.rotary_pct)
        return dim - dim % 2

    @property
    def attention_types(self) -> list[str]:
        """One attention type per layer (see :func:`expand_attention_config`)."""
        if not self.attention_config:
            return ["global"] * self.num_layers
        return expand_attention_config(self.attention_config, self.num_layers)

    def check_tensor_parallel(self, tp: int) -> None:
        """Raise if the sizes that tensor parallelism splits do not divide by `tp`."""
        splits = {
            "num_attention_heads": self.num_attention_heads,
            "num_kv_heads": self.kv_heads,
            "padded_vocab_size": self.padded_vocab_size,
            "the MLP width (intermediate_size / expansion_factor * hidden_size)": self.ffn_hidden_size,
        }
        if self.moe_num_experts > 1:
            splits["moe_num_experts (each tp rank holds whole experts)"] = self.moe_num_experts
        bad = [f"{key}={value}" for key, value in splits.items() if value % tp != 0]
        if bad:
            raise ModelConfigError(
                f"tensor parallelism splits these across {tp} ranks, but they are not divisible by {tp}: "
                + ", ".join(bad)
            )

    def attention_window(self, layer_number: int) -> int | None:
        """Sliding-window width of this layer's attention, or None for full causal attention."""
        types = self.attention_types
        if any(t in _LOCAL_ATTENTION for t in types):
            return self.sliding_window_width if types[layer_number] in _LOCAL_ATTENTION else None
        return self.sliding_window_width

    def init_fn(self) -> InitFn:
        """Init for input-side weights (embeddings, QKV, first MLP projection, untied output)."""
        return init_method_from_name(self.init_method, self.init_method_std, self.num_layers, self.hidden_size)

    def output_init_fn(self) -> InitFn:
        """Init for the layers that write into the residual stream (attention dense, MLP out)."""
        return init_method_from_name(
            self.output_layer_init_method, self.init_method_std, self.num_layers, self.hidden_size
        )

    def replace(self, **changes: Any) -> "GPTConfig":
        return dataclasses.replace(self, **changes)

    def with_vocab(self, padded_vocab_size: int) -> "GPTConfig":
        """The same architecture with the embedding sized for the tokenizer."""
        return dataclasses.replace(self, padded_vocab_size=padded_vocab_size)

    # --- from the trainer's arguments ---------------------------------------------------
    @classmethod
    def from_args(cls, args: NeoXArgs) -> "GPTConfig":
        """The architecture keys of the validated arguments.

        ``padded_vocab_size`` is the config's explicit value or a placeholder until the tokenizer is
        known (``with_vocab``). Kernel-selection hints (``bias_gelu_fusion``, ...) are not read:
        they choose kernels, not maths (see ``megatron.neox_arguments.honesty.NO_EFFECT_KEYS``).
        """
        from megatron.training.objectives.registry import needs_of

        precision = args.precision or "fp32"
        return cls(
            num_layers=_required(args.num_layers, "num_layers"),
            hidden_size=_required(args.hidden_size, "hidden_size"),
            num_attention_heads=_required(args.num_attention_heads, "num_attention_heads"),
            num_kv_heads=args.num_kv_heads,
            seq_length=_required(args.seq_length, "seq_length"),
            max_position_embeddings=args.max_position_embeddings,
            padded_vocab_size=args.padded_vocab_size or 0,
            pos_emb=args.pos_emb,
            rotary_pct=args.rotary_pct,
            rotary_emb_base=args.rotary_emb_base,
            rope_scaling=args.rope_scaling,  # HF's dict, parsed in __post_init__
            rpe_num_buckets=args.rpe_num_buckets,
            rpe_max_distance=args.rpe_max_distance,
            rotary_save_freqs_buffer=args.rotary_save_freqs_buffer,
            opt_pos_emb_offset=args.opt_pos_emb_offset,
            norm=args.norm,
            layernorm_epsilon=args.layernorm_epsilon,
            rms_norm_epsilon=args.rms_norm_epsilon,
            scalenorm_epsilon=args.scalenorm_epsilon,
            use_qk_layernorm=args.use_qk_layernorm,
            scale_attn_by_inverse_layer_idx=args.scale_attn_by_inverse_layer_idx,
            use_bias_in_norms=args.use_bias_in_norms,
            use_bias_in_attn_linear=args.use_bias_in_attn_linear,
            use_bias_in_mlp=args.use_bias_in_mlp,
            activation=args.activation,
            intermediate_size=args.intermediate_size,
            expansion_factor=args.expansion_factor,
            mlp_multiple_of=args.mlp_multiple_of,
            gpt_j_residual=args.gpt_j_residual,
            gpt_j_tied=args.gpt_j_tied,
            no_weight_tying=args.no_weight_tying,
            value_head=needs_of(args.train_impl).value_head,
            init_method=args.init_method,
            output_layer_init_method=args.output_layer_init_method,
            init_method_std=args.init_method_std,
            hidden_dropout=args.hidden_dropout,
            attention_dropout=args.attention_dropout,
            sliding_window_width=args.sliding_window_width,
            attention_config=args.attention_config,
            moe_num_experts=args.moe_num_experts,
            moe_expert_interval=args.moe_expert_interval,
            moe_top_k=args.moe_top_k,
            moe_router_type=args.moe_router_type,
            moe_lbl_in_fp32=args.moe_lbl_in_fp32,
            moe_jitter_eps=args.moe_jitter_eps,
            moe_aux_loss_coeff=args.moe_aux_loss_coeff,
            moe_z_loss_coeff=args.moe_z_loss_coeff,
            params_dtype=_DTYPES[precision],
            seed=args.seed,
            sequence_parallel=args.sequence_parallel,
        )


def expand_attention_config(config: list[Any], num_layers: int) -> list[str]:
    """GPT-NeoX's ``[[types, repeat], ...]`` as one type per layer: each entry contributes its
    ``types`` list ``repeat`` times (``[["global", "local"], 6]`` is 12 layers); ``"all"`` repeats
    the list to fill ``num_layers`` and must divide it. A list of plain strings is already expanded.
    The result must have exactly ``num_layers`` entries."""
    if all(isinstance(item, str) for item in config):
        types = list(config)
    else:
        types = []
        for kinds, repeats in config:
            if repeats == "all":
                if num_layers % len(kinds) != 0:
                    raise ModelConfigError(
                        f"attention_config entry {[list(kinds), 'all']}: {len(kinds)} types do not divide "
                        f"num_layers={num_layers}"
                    )
                repeats = num_layers // len(kinds)
            types.extend(list(kinds) * int(repeats))
    if len(types) != num_layers:
        raise ModelConfigError(
            f"attention_config describes {len(types)} layers but num_layers={num_layers}: the repeats "
            f"(each entry's types times its count) must add up to num_layers"
        )
    return types


def _required(value: int | None, key: str) -> int:
    if value is None:
        raise ModelConfigError(f"{key} is not set: every model needs num_layers, hidden_size, "
                               f"num_attention_heads and seq_length")
    return value
