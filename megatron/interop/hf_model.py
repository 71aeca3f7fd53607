"""Writing and reading ``transformers`` model directories, and the logit-parity check.

The parity check is the point of the converters: both models run one fixed batch in fp32 and the
largest absolute difference of any logit is reported. A conversion that gets a layout or a config
field wrong (a permuted QKV, an off-by-one window, a default ``intermediate_size``) shows up as a
difference of order 1, far above float noise (~1e-6).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from megatron.errors import ConversionError
from megatron.interop.hf_config import HFArchitecture
from megatron.model.config import GPTConfig

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

log = logging.getLogger("deepy.interop")

PARITY_TOLERANCE = 1e-4
"""Largest |Δ logit| accepted in fp32 (GPT-NeoX's issue tracker is full of conversions that were off by 1-10)."""

Weights = dict[str, torch.Tensor]


def _quiet_transformers() -> None:
    # offline and without progress bars: conversions never download, and tools print their own progress
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    # lazy: transformers (seconds to import), only for Hugging Face conversions
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def save_hf_model(hf_config: "PretrainedConfig", state: Weights, out_dir: Path, dtype: torch.dtype) -> None:
    """``save_pretrained`` (safetensors) of a model holding exactly ``state``, cast to ``dtype``."""
    _quiet_transformers()
    # lazy: transformers (seconds to import), only for Hugging Face conversions
    from transformers import AutoModelForCausalLM

    # built on the meta device: no random init of weights that are replaced right away
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    expected = set(model.state_dict())
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise ConversionError(
            f"weights do not fit {type(model).__name__}: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    model.load_state_dict(_unshared(state, dtype), strict=True, assign=True)
    if hf_config.tie_word_embeddings:
        model.tie_weights()
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)


def _unshared(state: Weights, dtype: torch.dtype) -> Weights:
    """``state`` in ``dtype`` with no two entries sharing memory (a shared norm is written twice; the
    tied head is re-tied by ``tie_weights``): safetensors refuses aliases it was not told about."""
    seen: set[int] = set()
    out: Weights = {}
    for name, tensor in state.items():
        t = tensor.detach().to(dtype).contiguous()
        if t.data_ptr() in seen or t.data_ptr() == tensor.data_ptr():
            t = t.clone()
        seen.add(t.data_ptr())
        out[name] = t
    return out


@dataclass(frozen=True)
class HFCheckpoint:
    config: "PretrainedConfig"
    architecture: HFArchitecture
    state: Weights
    dtype: torch.dtype


_ARCHITECTURES: dict[str, HFArchitecture] = {
    "gpt_neox": "GPTNeoXForCausalLM",
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "mamba": "MambaForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "gemma": "GemmaForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}


def load_hf_model(model_dir: Path, dtype: torch.dtype | None = None) -> "PreTrainedModel":
    """A local ``transformers`` causal LM (never downloads), in ``dtype`` or as stored."""
    _quiet_transformers()
    # lazy: transformers (seconds to import), only for Hugging Face conversions
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=dtype if dtype is not None else "auto", local_files_only=True
        ).eval()
    except (OSError, ValueError, KeyError) as err:
        raise ConversionError(f"{model_dir}: cannot load it as a transformers causal LM ({err})") from None


def read_hf_checkpoint(model_dir: Path) -> HFCheckpoint:
    """Config and state dict of a local HF GPTNeoX / Llama / Mistral / Mamba model directory."""
    if not (model_dir / "config.json").is_file():
        raise ConversionError(f"{model_dir} is not a Hugging Face model directory (no config.json)")
    model = load_hf_model(model_dir)
    kind = model.config.model_type
    if kind not in _ARCHITECTURES:
        raise ConversionError(f"{model_dir}: model_type {kind!r} is not supported (gpt_neox, llama, mistral, qwen2, "
                              f"mamba, mixtral, qwen3_moe are)")
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    dtype = next(model.parameters()).dtype
    return HFCheckpoint(config=model.config, architecture=_ARCHITECTURES[kind], state=state, dtype=dtype)


# --- parity ------------------------------------------------------------------------------------
def fixed_batch(vocab_size: int, seq_length: int, batch: int = 2, seed: int = 0) -> torch.Tensor:
    """The same token ids `[batch, seq]` on every call (a generator of its own, not the global one)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, seq_length), generator=gen)


def parity_seq_length(config: GPTConfig) -> int:
    """Long enough that a sliding window actually cuts, short enough to stay cheap."""
    window = config.sliding_window_width or 0
    return max(2, min(config.max_positions, max(32, window + 16)))


def build_gpt_model(config: GPTConfig, weights: Weights) -> torch.nn.Module:
    """Our model in one process (tp = 1) in fp32 eval mode, holding ``weights``."""
    # lazy: the model imports DeepSpeed; the conversions run without it
    from megatron.model.gpt import GPTModel

    fp32 = config.replace(
        precision="fp32", hidden_dropout=0.0, attention_dropout=0.0, sequence_parallel=False
    )
    model = GPTModel(fp32).eval()
    expected = set(model.state_dict())
    missing, unexpected = sorted(expected - set(weights)), sorted(set(weights) - expected)
    if missing or unexpected:
        raise ConversionError(
            f"weights do not fit the model config: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    model.load_state_dict({k: v.float() for k, v in weights.items()}, strict=True)
    return model


@torch.no_grad()
def max_logit_difference(ours: torch.nn.Module, theirs: torch.nn.Module, tokens: torch.Tensor) -> float:
    """max |Δ| over every logit of `tokens` `[b, s]`, both models in fp32."""
    a = ours(tokens).float()  # [b, s, v]
    b = theirs(input_ids=tokens).logits.float()  # [b, s, v]
    if a.shape != b.shape:
        raise ConversionError(f"logits have different shapes: ours {tuple(a.shape)}, transformers {tuple(b.shape)}")
    return float((a - b).abs().max())


def verify_parity(config: GPTConfig, weights: Weights, hf_dir: Path, tolerance: float = PARITY_TOLERANCE) -> float:
    """Load ``hf_dir`` in fp32, compare with our model holding ``weights``; raise above ``tolerance``."""
    ours = build_gpt_model(config, weights)
    theirs = load_hf_model(hf_dir, torch.float32)
    tokens = fixed_batch(config.vocab, parity_seq_length(config))
    delta = max_logit_difference(ours, theirs, tokens)
    if not delta <= tolerance:  # also catches NaN
        raise ConversionError(
            f"parity check failed: max |logits(Deepy) - logits(transformers)| = {delta:.3e} > {tolerance:.0e} on a "
            f"fixed batch {tuple(tokens.shape)} in fp32; the converted model does not compute the same function"
        )
    return delta
