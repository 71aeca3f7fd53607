"""The two conversions end to end, as the command-line tools run them.

``export_to_hf``: a Deepy checkpoint (any layout) -> a ``transformers`` model directory + tokenizer,
then the parity check. ``import_to_deepy``: an HF model directory or a GPT-NeoX checkpoint -> a
weights-only Deepy checkpoint at the requested tp/pp + ``deepy_model.yml``, then a re-read of what
was written and (for HF sources) the parity check against the source model.
"""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import torch

from megatron.atomic_files import follow_umask
from megatron.checkpointing.save_load import SHAPE_KEYS
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
from megatron.checkpointing import commit
from megatron.checkpointing.discovery import find_gpt_neox_tag
from megatron.checkpointing.neox import GqaOrder, read_neox_checkpoint, read_neox_config
from megatron.interop.yaml_config import CONFIG_NAME, architecture_keys, vocab_divisor, write_config
from megatron.model.config import GPTConfig

Precision = Literal["auto", "fp32", "bf16", "fp16"]
Progress = Callable[[str], None]

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_DEEPY_PRECISION = {torch.float32: "fp32", torch.bfloat16: "bfloat16", torch.float16: "fp16"}
_FROM_ARGS = {"bfloat16": "bf16", "bf16": "bf16", "fp16": "fp16", "float16": "fp16", "fp32": "fp32", "float32": "fp32"}


def _quiet(_: str) -> None:
    pass


@contextmanager
def staged_output(out: Path, last: tuple[str, ...] = ()) -> Iterator[Path]:
    """A new directory beside ``out`` for a conversion to write into, moved into ``out`` when the block
    succeeds: a conversion that fails (a check, a bad file) or is killed leaves nothing in ``out`` that looks
    finished (a commit marker, a loadable config). ``out`` must be new or empty; on failure the directory
    written is removed and ``out`` is as it was (absent, or the empty directory the user made). Into an
    existing ``out`` the entries move one by one, those named in ``last`` last (the config that says where
    the checkpoint is)."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConversionError(f"output directory {out} is not empty; choose a new one")
    created = [p for p in (out, *out.parents) if not p.exists()]  # deepest first, removed again on failure
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.parent / f".{out.name}.partial-{os.getpid()}-{secrets.token_hex(4)}"
    staging.mkdir()  # the umask's permissions (mkdtemp's would be 0700), kept by the rename
    moved: list[Path] = []
    try:
        yield staging
        follow_umask(staging)  # save_pretrained's safetensors file is written 0o600
        if not out.exists():
            staging.rename(out)
            return
        for entry in sorted(staging.iterdir(), key=lambda p: (last.index(p.name) + 1 if p.name in last else 0, p.name)):
            entry.rename(out / entry.name)
            moved.append(out / entry.name)
        staging.rmdir()
    except BaseException:
        for path in [staging, *moved]:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            elif path.exists() or path.is_symlink():
                path.unlink()
        for made in created:
            if not made.exists():
                continue
            try:
                made.rmdir()
            except OSError:
                break  # not empty (something else wrote there) or already gone
        raise


def _moved(files: TokenizerFiles | None, staging: Path, out: Path) -> TokenizerFiles | None:
    """The tokenizer files as they will be named once ``staging`` is ``out``."""
    if files is None:
        return None

    def final(path: str | None) -> str | None:
        if path is None or not Path(path).is_relative_to(staging.resolve()):
            return path
        return str(out.resolve() / Path(path).relative_to(staging.resolve()))

    return replace(files, vocab_file=final(files.vocab_file), merge_file=final(files.merge_file))


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
            flag = next((k for k, v in NEOX_ARCHITECTURES.items() if v == chosen), None)
            # Qwen2 and Mamba have no GPT-NeoX flag (ea7aefd8's convert_neox_to_hf.py knows neox, llama, mistral)
            fix = (f"--architecture {flag}" if flag
                   else "GPT-NeoX's converter has no flag for it: leave --architecture out")
            problems.append(f"--architecture {architecture}: {ckpt} holds a {chosen} model ({fix})")
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
    hf_class: str | None = None,
) -> ExportReport:
    """``hf_class``: ``Phi3ForCausalLM`` writes a model whose maths is Llama's (or Mistral's) as Phi-3's fused
    projections; otherwise the class follows from the checkpoint's config (``hf_config.choose_architecture``)."""
    ckpt = resolve_checkpoint(checkpoint, iteration)
    config, args = read_checkpoint_config(ckpt)
    arch = choose_architecture(config, hf_class)  # refuse before reading any tensor
    name = args.get("precision") or "fp32"
    dtype = DTYPES[_FROM_ARGS.get(str(name), "fp32") if precision == "auto" else precision]
    files = TokenizerFiles(
        str(args.get("tokenizer_type") or "GPT2BPETokenizer"),
        vocab_file or args.get("vocab_file"),
        merge_file or args.get("merge_file"),
    )
    recorded = args.get("tokenizer_type") is not None or bool(vocab_file or merge_file or args.get("vocab_file"))
    if tokenizer and not recorded:
        raise ConversionError(f"{ckpt} records no tokenizer (it was imported without tokenizer files): pass "
                              f"--no-tokenizer to export the model alone, or --vocab-file/--merge-file")
    # written beside out_dir and moved in once verified: a failed export leaves no loadable model behind
    with staged_output(out_dir, last=("config.json",)) as work:
        if tokenizer:
            progress(f"writing the {files.tokenizer_type} tokenizer")
            tokens = export_tokenizer(files, work, config.max_positions)
        elif not recorded:
            # a model imported without tokenizer files records no tokenizer: no special-token ids to name
            tokens = SpecialTokens(bos=None, eos=None, pad=None)
        else:
            tokens = special_tokens_of(files)
        progress(f"reading {ckpt}")
        full = read_full_checkpoint(ckpt)
        progress(f"writing {arch} ({str(dtype).removeprefix('torch.')}) to {out_dir}")
        hf_config = hf_config_from_gpt(config, tokens, dtype, hf_class)
        save_hf_model(hf_config, to_hf_state_dict(config, arch, full.weights), work, dtype)
        delta = None
        if verify:
            progress("verifying: both models on a fixed batch in fp32")
            delta = verify_parity(config, _cast(_cast(full.weights, dtype), torch.float32), work)
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
    if choose_architecture(config, hf.architecture) != hf.architecture:  # Phi-3: exported back with hf_class
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
    # written beside out_dir and moved in once every check passed: a conversion that fails leaves no committed
    # checkpoint or loadable deepy_model.yml behind (the files name out_dir, where they end up)
    with staged_output(out_dir, last=(commit.LATEST_FILE, CONFIG_NAME)) as work:
        if kind == "hf":
            src = _read_hf(source, work, seq_length, progress)
        else:
            src = _read_neox(source, neox_configs, neox_qkv_order, progress)
        config = src.config
        config.check_tensor_parallel(tp)
        dtype = src.dtype if precision == "auto" else DTYPES[precision]
        vocab = _tokenizer_vocab(src.tokenizer, progress)
        divisor = vocab_divisor(config.vocab, vocab, tp, src.preferred_divisor)
        finetune = src.iteration == 0
        description = f"{'Hugging Face model' if kind == 'hf' else 'GPT-NeoX checkpoint'} {source.resolve()}"
        tokenizer = _moved(src.tokenizer, work, out_dir)
        write_config(work, config=config, tokenizer=tokenizer, vocab_divisible_by=divisor,
                     precision=_DEEPY_PRECISION[dtype], tp=tp, pp=pp, finetune=finetune, source=description,
                     load=out_dir)  # fmt: skip
        args: dict[str, Any] = {**architecture_keys(config), "padded_vocab_size": config.padded_vocab_size,
                                "precision": _DEEPY_PRECISION[dtype], "model_parallel_size": tp,
                                "pipe_parallel_size": pp}
        if tokenizer is not None:
            args.update(tokenizer_type=tokenizer.tokenizer_type, vocab_file=tokenizer.vocab_file,
                        merge_file=tokenizer.merge_file, make_vocab_size_divisible_by=divisor)  # fmt: skip
        weights = _cast(src.weights, dtype)
        progress(f"writing a Deepy checkpoint at tp={tp} pp={pp} to {out_dir}")
        ckpt = write_weights_only_checkpoint(
            work, config=config, weights=weights, tp=tp, pp=pp, step=src.iteration,
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
    return ImportReport(source, kind, out_dir / ckpt.name, out_dir / CONFIG_NAME, src.iteration, delta)


def _check_written(ckpt: Path, config: GPTConfig, weights: dict[str, torch.Tensor]) -> None:
    """What a training run will read back is what was converted, tensor for tensor."""
    back = read_full_checkpoint(ckpt)
    # every key that changes the weights or the function; one the model does not read (use_bias_in_norms of an
    # RMSNorm, which deepy_model.yml leaves out) may differ
    differ = config.differences(back.config.replace(precision=config.precision))
    if differ:
        raise ConversionError(f"{ckpt.name}: the stored arguments describe another model than the one converted: "
                              + "; ".join(differ))
    differ = sorted(k for k in set(back.weights) | set(weights)
                    if k not in back.weights or k not in weights or not _same_bits(back.weights[k], weights[k]))
    if differ:
        raise ConversionError(f"{ckpt}: re-read tensors differ from the converted ones: {differ[:5]}")


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (a NaN read back as written is the same tensor; the model check reports it)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@torch.no_grad()
def _check_runs(config: GPTConfig, weights: dict[str, torch.Tensor]) -> None:
    """No reference model for a GPT-NeoX source: at least the model builds and its logits are finite."""
    model = build_gpt_model(config, weights)
    seq = required(config.seq_length, "seq_length", "the check runs a batch of that length")
    logits = model(fixed_batch(config.vocab, min(16, seq)))
    if not torch.isfinite(logits).all():
        raise ConversionError("the converted model produces non-finite logits")
