"""Export a Deepy checkpoint to a Hugging Face ``transformers`` model directory, and prove it.

    python tools/ckpts/convert_neox_to_hf.py CHECKPOINT OUTPUT_DIR [--precision auto|fp32|bf16|fp16]
    python tools/ckpts/convert_neox_to_hf.py --input_dir CHECKPOINT --config_file CONFIG.yml \
        --output_dir OUTPUT_DIR [--precision ...] [--architecture neox|llama|mistral]

The second form takes GPT-NeoX's own flags, so its users' scripts run unchanged. The checkpoint
records its architecture: ``--config_file`` must agree with it on every key that shapes the weights,
and ``--architecture`` must name the class it exports to (a mismatch is refused, naming the key).

CHECKPOINT is a save directory (its newest committed checkpoint, or ``--iteration N``) or one
``global_stepN`` directory, saved at any tp / pp / ZeRO layout. OUTPUT_DIR gets ``config.json``,
``model.safetensors`` and the tokenizer files: ``GPTNeoXForCausalLM`` for layernorm models,
``LlamaForCausalLM`` (``MistralForCausalLM`` with a sliding window) for rmsnorm + gated-MLP models. An
architecture transformers cannot reproduce exactly is refused with the feature named.

``--verify`` (on by default) then loads OUTPUT_DIR with transformers and runs it and our model on a
fixed batch in fp32; the export fails if any logit differs by more than 1e-4.

A checkpoint of a run with LoRA adapters (``lora_r > 0``) exports with ``--adapters merge`` (the
default: the adapters folded into the weights) or ``--adapters peft`` (the frozen base in OUTPUT_DIR
and a PEFT adapter directory in OUTPUT_DIR/lora_adapter, verified by loading it with ``peft``); see
``megatron/interop/lora_export.py``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megatron.errors import run_guarded

REPO = Path(__file__).resolve().parents[2]

def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path, nargs="?", help="a Deepy save directory or one global_stepN directory")
    parser.add_argument("output", type=Path, nargs="?", help="new (or empty) directory for the transformers model")
    parser.add_argument("--input_dir", type=Path, default=None, help="GPT-NeoX's name for CHECKPOINT")
    parser.add_argument("--output_dir", type=Path, default=None, help="GPT-NeoX's name for OUTPUT_DIR")
    parser.add_argument("--config_file", type=Path, default=None,
                        help="the run's GPT-NeoX/Deepy config file (checked against the checkpoint's architecture)")
    parser.add_argument("--architecture", choices=["neox", "llama", "mistral"], default=None,
                        help="GPT-NeoX's model family flag (checked against the checkpoint's architecture)")
    parser.add_argument("--hf_class", choices=["Phi3ForCausalLM"], default=None,
                        help="write a model whose maths is Llama's (or Mistral's) as Phi-3's fused projections "
                             "(without it a Phi-3 import exports as Llama or Mistral, or is refused, naming this "
                             "flag, when it rotates a fraction of each head)")
    parser.add_argument("--iteration", type=int, default=None, help="which committed checkpoint of a save directory")
    parser.add_argument("--precision", choices=["auto", "fp32", "bf16", "fp16"], default="auto",
                        help="dtype of the written weights (auto: the run's precision)")
    parser.add_argument("--verify", action=argparse.BooleanOptionalAction, default=True,
                        help="compare both models' logits on a fixed batch (max |diff| <= 1e-4 in fp32)")
    parser.add_argument("--vocab-file", default=None, help="the tokenizer's vocab_file, if it moved since training")
    parser.add_argument("--merge-file", default=None, help="the tokenizer's merge_file, if it moved since training")
    parser.add_argument("--no-tokenizer", "--no_save_tokenizer", dest="no_tokenizer", action="store_true",
                        help="write the model without tokenizer files (--no_save_tokenizer: GPT-NeoX's name)")
    parser.add_argument("--adapters", choices=["merge", "peft"], default=None,
                        help="a LoRA checkpoint: merge the adapters into the weights (default) or write the base "
                             "plus a PEFT adapter directory (OUTPUT/lora_adapter)")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    opts = parser.parse_args(argv)
    for positional, flag in (("checkpoint", "input_dir"), ("output", "output_dir")):
        given = [value for value in (getattr(opts, positional), getattr(opts, flag)) if value is not None]
        if len(given) != 1:
            parser.error(f"give {positional.upper()} or --{flag}, once")
        setattr(opts, positional, given[0])
    return opts


def export_lora_checkpoint(opts: argparse.Namespace) -> int | None:
    """Export a checkpoint with LoRA adapters (None: it has none, the plain export applies)."""
    from megatron.errors import ConversionError
    from megatron.interop.deepy_checkpoint import read_checkpoint_config, read_full_checkpoint, resolve_checkpoint
    from megatron.interop.hf_tokenizer import TokenizerFiles
    from megatron.interop.lora_export import export_adapters, has_adapters

    ckpt = resolve_checkpoint(opts.checkpoint, opts.iteration)
    config, args = read_checkpoint_config(ckpt)
    if not has_adapters(args):
        if opts.adapters is not None:
            raise ConversionError(f"--adapters {opts.adapters}: {ckpt} was trained without LoRA adapters (lora_r 0)")
        return None
    files = TokenizerFiles(str(args.get("tokenizer_type") or "GPT2BPETokenizer"),
                           opts.vocab_file or args.get("vocab_file"), opts.merge_file or args.get("merge_file"))
    report = export_adapters(ckpt, config, args, read_full_checkpoint(ckpt).weights, opts.output,
                             mode=opts.adapters or "merge", precision=opts.precision, verify=opts.verify,
                             tokenizer_files=files, tokenizer=not opts.no_tokenizer,
                             progress=lambda line: print(line, flush=True), hf_class=opts.hf_class)
    where = f"{report.out_dir} + PEFT adapter {report.adapter_dir}" if report.adapter_dir else str(report.out_dir)
    print(f"wrote {report.architecture} ({str(report.dtype).removeprefix('torch.')}) from {report.checkpoint} to {where}")
    if report.max_logit_diff is not None:
        print(f"verified: max |logits(Deepy with adapters) - logits({'peft' if report.adapter_dir else 'transformers'})| "
              f"= {report.max_logit_diff:.2e} (fp32, <= 1e-4)")
    return 0


def main() -> int:
    opts = parse_args(sys.argv[1:])
    from megatron.errors import UsageError
    from megatron.interop.convert import check_neox_flags, export_to_hf

    if opts.config_file is not None and not opts.config_file.is_file():
        stored = opts.checkpoint / "configs"
        hint = (f"; the checkpoint keeps its config files in {stored}: "
                f"{', '.join(sorted(p.name for p in stored.iterdir()))}" if stored.is_dir() else "")
        raise UsageError(f"--config_file {opts.config_file}: no such file{hint}")

    check_neox_flags(opts.checkpoint, opts.iteration, opts.config_file, opts.architecture)
    lora_code = export_lora_checkpoint(opts)
    if lora_code is not None:
        return lora_code

    report = export_to_hf(
        opts.checkpoint,
        opts.output,
        precision=opts.precision,
        verify=opts.verify,
        iteration=opts.iteration,
        vocab_file=opts.vocab_file,
        merge_file=opts.merge_file,
        tokenizer=not opts.no_tokenizer,
        progress=lambda line: print(line, flush=True),
        hf_class=opts.hf_class,
    )
    print(f"wrote {report.architecture} ({str(report.dtype).removeprefix('torch.')}) from {report.checkpoint} "
          f"to {report.out_dir}")  # fmt: skip
    if report.max_logit_diff is not None:
        print(f"verified: max |logits(Deepy) - logits(transformers)| = {report.max_logit_diff:.2e} (fp32, <= 1e-4)")
    return 0


def cli() -> None:
    """The ``deepy-convert-neox-to-hf`` console script: clean one-line errors, exit code 2."""
    run_guarded(main)


if __name__ == "__main__":
    cli()
