"""Import a Hugging Face model or a GPT-NeoX checkpoint as a Deepy checkpoint at a chosen tp / pp.

    python tools/ckpts/convert_hf_to_neox.py SOURCE OUTPUT_DIR [--tp N] [--pp N]

SOURCE is either

* a ``transformers`` model directory (``config.json`` + weights) of a GPTNeoX, Llama or Mistral
  model, local only (nothing is downloaded); its tokenizer is copied along, or
* a GPT-NeoX (DeeperSpeed) checkpoint: a ``global_stepN`` directory or the save directory holding
  ``latest``; its config is read from ``global_stepN/configs/`` or ``--config FILE ...``.

OUTPUT_DIR gets ``global_stepN/`` (the weights, sharded for ``--tp`` and ``--pp``; ``--pp 0`` is the
model without DeepSpeed's pipeline wrapper) and ``deepy_model.yml``, which sets the architecture,
tokenizer, layout and ``load``:

    python deepy.py train.py OUTPUT_DIR/deepy_model.yml your_data_and_schedule.yml

Everything is written beside OUTPUT_DIR and moved in once every check passed: a conversion that fails leaves
OUTPUT_DIR as it was (absent, or the empty directory you made).

The checkpoint holds weights only: the first run starts its optimizer fresh (fine-tuning from an
HF model starts at step 0; a GPT-NeoX run continues at its iteration). ``--verify`` (default)
compares our model with the source transformers model on a fixed batch (max |Δ logit| <= 1e-4).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megatron.errors import run_guarded

REPO = Path(__file__).resolve().parents[2]

def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", type=Path, help="a transformers model directory or a GPT-NeoX checkpoint")
    parser.add_argument("output", type=Path, help="new (or empty) directory for the Deepy checkpoint")
    parser.add_argument("--tp", type=int, default=1, help="tensor parallelism to shard for (model_parallel_size)")
    parser.add_argument("--pp", type=int, default=1, help="pipe_parallel_size to write for (0: no pipeline wrapper)")
    parser.add_argument("--precision", choices=["auto", "fp32", "bf16", "fp16"], default="auto",
                        help="dtype of the written weights (auto: as stored in the source)")
    parser.add_argument("--seq-length", type=int, default=None,
                        help="seq_length for the written config (default: max_position_embeddings)")
    parser.add_argument("--config", type=Path, nargs="+", default=None,
                        help="GPT-NeoX config files, when the checkpoint has no configs/ directory")
    parser.add_argument("--neox-qkv-order", choices=["per_rank", "per_query_head"], default=None,
                        help="a grouped-query GPT-NeoX checkpoint's QKV row order, which its files cannot say: "
                             "per_rank (GPT-NeoX since Nov 2024) or per_query_head (earlier)")
    parser.add_argument("--verify", action=argparse.BooleanOptionalAction, default=True,
                        help="compare Deepy's and transformers' logits on a fixed batch (HF sources)")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    return parser.parse_args(argv)


def main() -> int:
    opts = parse_args(sys.argv[1:])
    from megatron.interop.convert import import_to_deepy

    report = import_to_deepy(
        opts.source,
        opts.output,
        tp=opts.tp,
        pp=opts.pp,
        precision=opts.precision,
        verify=opts.verify,
        seq_length=opts.seq_length,
        neox_configs=opts.config,
        neox_qkv_order=opts.neox_qkv_order,
        progress=lambda line: print(line, flush=True),
    )
    print(f"wrote {report.checkpoint} (iteration {report.iteration}) and {report.config_file}")
    if report.max_logit_diff is not None:
        print(f"verified: max |logits(Deepy) - logits(transformers)| = {report.max_logit_diff:.2e} (fp32, <= 1e-4)")
    print(f"next: python deepy.py train.py {report.config_file} <your data and schedule configs>")
    return 0


def cli() -> None:
    """The ``deepy-convert-hf-to-neox`` console script: clean one-line errors, exit code 2."""
    run_guarded(main)


if __name__ == "__main__":
    cli()
