"""The two conversions end to end, as the command-line tools run them.

``export_to_hf``: a Deepy checkpoint (any layout) -> a ``transformers`` model directory + tokenizer,
then the parity check. ``import_to_deepy``: an HF model directory or a GPT-NeoX checkpoint -> a
weights-only Deepy checkpoint at the requested tp/pp + ``deepy_model.yml``, then a re-read of what
was written and (for HF sources) the parity check against the source model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from megatron.errors import ConversionError, DeepyError, required
from megatron.interop.deepy_checkpoint import (
    read_checkpoint_config,
    read_full_checkpoint,
    resolve_checkpoint,
    write_weights_only_checkpoint,
)
from megatron.interop.hf_config import (
    HFArchitecture,
    SpecialTokens,
    choose_architecture,
    gpt_config_from_hf,
    hf_config_from_gpt,
)
from megatron.interop.hf_model import build_gpt_model, fixed_batch, read_hf_checkpoint, save_hf_model, verify_parity
from megatron.interop.hf_tokenizer import (
    TokenizerFiles,
    build_tokenizer_from_files,
    export_tokenizer,
    import_tokenizer,
    special_tokens_of,
)
from megatron.interop.hf_weights import from_hf_state_dict, to_hf_state_dict
from megatron.checkpointing.discovery import find_gpt_neox_tag
from megatron.checkpointing.neox import GqaOrder, read_neox_checkpoint
from megatron.interop.yaml_config import architecture_keys, vocab_divisor, write_config
from megatron.model.config import GPTConfig

Precision = Literal["auto", "fp32", "bf16", "fp16"]
Progress = Callable[[str], None]

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_DEEPY_PRECISION = {torch.float32: "fp32", torch.bfloat16: "bfloat16", torch.float16: "fp16"}
_FROM_ARGS = {"bfloat16": "bf16", "bf16": "bf16", "fp16": "fp16", "float16": "fp16", "fp32": "fp32", "float32": "fp32"}


def _quiet(_: str) -> None:
    pass


def _empty_output(out: Path) -> None:
    if out.exists() and any(out.iterdir()):
        raise ConversionError(f"output directory {out} is not empty; choose a new one")
    out.mkdir(parents=True, exist_ok=True)


def _cast(weights: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {k: v.to(dtype) for k, v in weights.items()}


# --- Deepy -> transformers -------------------------------------------------------------------------
@dataclass(frozen=True)
class ExportReport:
    checkpoint: Path
    out_dir: Path
    architecture: str
    dtype: torch.dtype
    tokenizer_written: bool
    max_logit_diff: float | None


NEOX_ARCHITECTURES: dict[str, HFArchitecture] = {
    "neox": "GPTNeoXForCausalLM", "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
}  # fmt: skip
"""GPT-NeoX's ``convert_neox_to_hf.py --architecture`` values and the transformers class each writes."""


def check_neox_flags(checkpoint: Path, iteration: int | None, config_file: Path | None,
                     architecture: str | None) -> None:
    """GPT-NeoX's converter flags on a Deepy checkpoint, checked before anything is written: the
    checkpoint records its own architecture, so ``--config_file`` must agree with it on every key that
    shapes the weights and ``--architecture`` must name the class the checkpoint exports to."""
    from megatron.checkpointing.save_load import SHAPE_KEYS
    from megatron.checkpointing.neox import read_neox_config

    ckpt = resolve_checkpoint(checkpoint, iteration)
    config, args = read_checkpoint_config(ckpt)
    problems = []
    if config_file is not None:
        values, _ = read_neox_config([config_file])
        problems += [f"{key}: {config_file} says {values[key]!r}, the checkpoint was trained with {args.get(key)!r}"
                     for key in SHAPE_KEYS if key in values and key in args and values[key] != args[key]]
    if architecture is not None:
        chosen = choose_architecture(config)
        if NEOX_ARCHITECTURES[architecture] != chosen:
            problems.append(f"--architecture {architecture}: {ckpt} holds a {chosen} model "
                            f"(--architecture {next(k for k, v in NEOX_ARCHITECTURES.items() if v == chosen)})")
    if problems:
        raise ConversionError("the GPT-NeoX converter flags do not match the checkpoint:\n  " + "\n  ".join(problems))


def export_to_hf(
    checkpoint: Path,
    out_dir: Path,
    *,
    precision: Precision = "auto",
    verify: bool = True,
    iteration: int | None = None,
    vocab_file: str | None = None,
    merge_file: str | None = None,
    tokenizer: bool = True,
    progress: Progress = _quiet,
) -> ExportReport:
    ckpt = resolve_checkpoint(checkpoint, iteration)
    config, args = read_checkpoint_config(ckpt)
    arch = choose_architecture(config)  # refuse before reading any tensor
    name = args.get("precision") or "fp32"
    dtype = DTYPES[_FROM_ARGS.get(str(name), "fp32") if precision == "auto" else precision]
    _empty_output(out_dir)
    files = TokenizerFiles(
        str(args.get("tokenizer_type") or "GPT2BPETokenizer"),
        vocab_file or args.get("vocab_file"),
        merge_file or args.get("merge_file"),
    )
    recorded = args.get("tokenizer_type") is not None or bool(vocab_file or merge_file or args.get("vocab_file"))
    if tokenizer and not recorded:
        raise ConversionError(f"{ckpt} records no tokenizer (it was imported without tokenizer files): pass "
                              f"--no-tokenizer to export the model alone, or --vocab-file/--merge-file")
    if tokenizer:
        progress(f"writing the {files.tokenizer_type} tokenizer")
        tokens = export_tokenizer(files, out_dir, config.max_positions)
    elif not recorded:
        # a model imported without tokenizer files records no tokenizer: no special-token ids to name
        tokens = SpecialTokens(bos=None, eos=None, pad=None)
    else:
        tokens = special_tokens_of(files)
    progress(f"reading {ckpt}")
    full = read_full_checkpoint(ckpt)
    progress(f"writing {arch} ({str(dtype).removeprefix('torch.')}) to {out_dir}")
    hf_config = hf_config_from_gpt(config, tokens, dtype)
    save_hf_model(hf_config, to_hf_state_dict(config, arch, full.weights), out_dir, dtype)
    delta = None
    if verify:
        progress("verifying: both models on a fixed batch in fp32")
        delta = verify_parity(config, _cast(_cast(full.weights, dtype), torch.float32), out_dir)
    return ExportReport(ckpt, out_dir, arch, dtype, tokenizer, delta)


# --- transformers / GPT-NeoX -> Deepy -----------------------------------------------------------------
@dataclass(frozen=True)
class ImportReport:
    source: Path
    kind: Literal["hf", "gpt-neox"]
    checkpoint: Path
    config_file: Path
    iteration: int
    max_logit_diff: float | None


@dataclass(frozen=True)
class _Source:
    kind: Literal["hf", "gpt-neox"]
    config: GPTConfig
    weights: dict[str, torch.Tensor]
    dtype: torch.dtype
    iteration: int
    consumed_samples: int
    tokenizer: TokenizerFiles | None
    preferred_divisor: int


def detect_source(source: Path) -> Literal["hf", "gpt-neox"]:
    if (source / "config.json").is_file():
        return "hf"
    from megatron.checkpointing import commit

    tag, _ = commit.newest_committed(source)
    if (source / "deepy_meta.json").is_file() or tag is not None:
        raise ConversionError(f"{source} is already a Deepy checkpoint: point `load` at it directly")
    if source.is_dir() and find_gpt_neox_tag(source) is not None:
        return "gpt-neox"
    raise ConversionError(
        f"{source} is neither a Hugging Face model directory (config.json) nor a GPT-NeoX checkpoint "
        "(global_step*/ with mp_rank_*_model_states.pt or layer_*-model_*-model_states.pt)"
    )


def _read_hf(source: Path, out_dir: Path, seq_length: int | None, progress: Progress) -> _Source:
    progress(f"reading the Hugging Face model {source}")
    hf = read_hf_checkpoint(source)
    config = gpt_config_from_hf(hf.config, seq_length)
    if choose_architecture(config) != hf.architecture:
        raise ConversionError(f"{source}: this {hf.architecture} maps to a Deepy model that would export as "
                              f"{choose_architecture(config)}; refusing an asymmetric conversion")
    weights = from_hf_state_dict(config, hf.architecture, hf.state)
    files = import_tokenizer(source, out_dir)
    return _Source("hf", config, weights, hf.dtype, 0, 0, files, 128)


def _read_neox(source: Path, config_paths: list[Path] | None, qkv_order: GqaOrder | None,
               progress: Progress) -> _Source:
    progress(f"reading the GPT-NeoX checkpoint {source}")
    neox = read_neox_checkpoint(source, config_paths, qkv_order)
    values = neox.values
    files = TokenizerFiles(str(values.get("tokenizer_type") or "GPT2BPETokenizer"),
                           values.get("vocab_file"), values.get("merge_file"))  # fmt: skip
    dtype = neox.weights["embedding.word_embeddings.weight"].dtype
    divisor = int(values.get("make_vocab_size_divisible_by") or 128)
    return _Source("gpt-neox", neox.config, neox.weights, dtype, neox.iteration, neox.consumed_samples, files, divisor)


def _tokenizer_vocab(files: TokenizerFiles | None, progress: Progress) -> int | None:
    if files is None:
        return None
    try:
        return build_tokenizer_from_files(files).vocab_size
    except DeepyError as err:
        progress(f"warning: the tokenizer cannot be built here ({err}); check tokenizer keys in the written config")
        return None


def import_to_deepy(
    source: Path,
    out_dir: Path,
    *,
    tp: int = 1,
    pp: int = 1,
    precision: Precision = "auto",
    verify: bool = True,
    seq_length: int | None = None,
    neox_configs: list[Path] | None = None,
    neox_qkv_order: GqaOrder | None = None,
    progress: Progress = _quiet,
) -> ImportReport:
    kind = detect_source(source)
    _empty_output(out_dir)
    if kind == "hf":
        src = _read_hf(source, out_dir, seq_length, progress)
    else:
        src = _read_neox(source, neox_configs, neox_qkv_order, progress)
    config = src.config
    config.check_tensor_parallel(tp)
    dtype = src.dtype if precision == "auto" else DTYPES[precision]
    vocab = _tokenizer_vocab(src.tokenizer, progress)
    divisor = vocab_divisor(config.vocab, vocab, tp, src.preferred_divisor)
    finetune = src.iteration == 0
    description = f"{'Hugging Face model' if kind == 'hf' else 'GPT-NeoX checkpoint'} {source.resolve()}"
    config_file = write_config(out_dir, config=config, tokenizer=src.tokenizer, vocab_divisible_by=divisor,
                               precision=_DEEPY_PRECISION[dtype], tp=tp, pp=pp, finetune=finetune,
                               source=description)  # fmt: skip
    args: dict[str, Any] = {**architecture_keys(config), "padded_vocab_size": config.padded_vocab_size,
                            "precision": _DEEPY_PRECISION[dtype], "model_parallel_size": tp, "pipe_parallel_size": pp}
    if src.tokenizer is not None:
        args.update(tokenizer_type=src.tokenizer.tokenizer_type, vocab_file=src.tokenizer.vocab_file,
                    merge_file=src.tokenizer.merge_file, make_vocab_size_divisible_by=divisor)  # fmt: skip
    weights = _cast(src.weights, dtype)
    progress(f"writing a Deepy checkpoint at tp={tp} pp={pp} to {out_dir}")
    ckpt = write_weights_only_checkpoint(
        out_dir, config=config, weights=weights, tp=tp, pp=pp, step=src.iteration,
        consumed_samples=src.consumed_samples, args=args, source=description,
    )  # fmt: skip
    progress("re-reading the written checkpoint")
    _check_written(ckpt, config, weights)
    delta = None
    if verify:
        reference = _cast(weights, torch.float32)
        if kind == "hf":
            progress("verifying: Deepy and transformers on a fixed batch in fp32")
            delta = verify_parity(config, reference, source)
        else:
            _check_runs(config, reference)
    return ImportReport(source, kind, ckpt, config_file, src.iteration, delta)


def _check_written(ckpt: Path, config: GPTConfig, weights: dict[str, torch.Tensor]) -> None:
    """What a training run will read back is what was converted, tensor for tensor."""
    back = read_full_checkpoint(ckpt)
    if back.config.replace(precision=config.precision) != config:
        raise ConversionError(f"{ckpt}: the stored arguments describe another model than the one converted")
    differ = sorted(k for k in set(back.weights) | set(weights)
                    if k not in back.weights or k not in weights or not torch.equal(back.weights[k], weights[k]))
    if differ:
        raise ConversionError(f"{ckpt}: re-read tensors differ from the converted ones: {differ[:5]}")


@torch.no_grad()
def _check_runs(config: GPTConfig, weights: dict[str, torch.Tensor]) -> None:
    """No reference model for a GPT-NeoX source: at least the model builds and its logits are finite."""
    model = build_gpt_model(config, weights)
    seq = required(config.seq_length, "seq_length", "the check runs a batch of that length")
    logits = model(fixed_batch(config.vocab, min(16, seq)))
    if not torch.isfinite(logits).all():
        raise ConversionError("the converted model produces non-finite logits")
