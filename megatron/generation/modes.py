"""The four `text_gen_type` modes of generate.py, over a `ModelReplica` on every rank.

* `unconditional`: `num_samples` samples that start from EOD (a document boundary).
* `input-file`: the prompts of `sample_input_file`, separated by `prompt_end` (empty prompts are
  skipped), completed in order.
* `interactive`: rank 0 reads one prompt per line from stdin (EOF ends), every rank receives it,
  rank 0 prints the completion.
* `precompute`: reference log-probs of every configured token dataset (see `precompute.py`).

The first two write `sample_output_file` as JSON lines, one per sample, in prompt order::

    {"prompt": str, "text": str, "tokens": [int], "length": int, "finished": bool[, "logits": [[float]]]}

`text` is the completion only (the prompt is not repeated), `tokens` its token ids without the EOD
that ended it, `finished` false when `maximum_tokens` (or the context) ran out first, and
`logits` (with `return_logits: true`) the fp32 logits over the vocabulary before each generated
token. Prompts are spread over the data-parallel replicas (prompt i on replica i mod dp), each
sampled with its own generator seeded from (seed, i), so the output does not depend on the layout.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from megatron.atomic_files import atomic_path
from megatron.generation.config import SamplingParams, TextgenArgs
from megatron.generation.decode import Generated, StopCondition, generate
from megatron.generation.replica import ModelReplica
from megatron.generation.sampling import sample_generator
from megatron.logging.log import get_logger
from megatron.tokenizer import Tokenizer


def is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


@dataclass(frozen=True)
class TextGenerator:
    """A replica plus what turns text into prompts and tokens back into text."""

    replica: ModelReplica
    tokenizer: Tokenizer
    sampling: SamplingParams
    seq_length: int
    batch_size: int
    seed: int

    def complete_local(self, prompts: dict[int, list[int]], sampling: SamplingParams | None = None,
                       stop: StopCondition | None = None) -> dict[int, Generated]:
        """Complete this replica's prompts (index -> tokens) in batches of similar length;
        `stop` receives the prompt's index in `prompts`."""
        sampling = sampling or self.sampling
        order = sorted(prompts, key=lambda i: (len(prompts[i]), i))
        size = self.batch_size
        done: dict[int, Generated] = {}
        for first in range(0, len(order), size):
            batch = order[first : first + size]
            row_stop = None if stop is None else functools.partial(_stop_in_batch, stop, batch)
            results = generate(
                self.replica,
                [prompts[i] for i in batch],
                sampling,
                eod=self.tokenizer.eod,
                max_length=self.seq_length,
                generators=[sample_generator(self.seed, i) for i in batch],
                stop=row_stop,
            )
            done.update(zip(batch, results))
        return done

    def complete(self, prompts: list[list[int]], sampling: SamplingParams | None = None,
                 stop: StopCondition | None = None) -> list[Generated]:
        """Complete every prompt, spread over the data-parallel replicas; every rank gets all results."""
        mine = {i: p for i, p in enumerate(prompts) if i % self.replica.dp_size == self.replica.dp_rank}
        local = self.complete_local(mine, sampling, stop)
        merged: dict[int, Generated] = {}
        for part in self.replica.gather_over_replicas(local):
            merged.update(part)
        return [merged[i] for i in range(len(prompts))]

    def record(self, prompt: str, generated: Generated) -> dict[str, Any]:
        row: dict[str, Any] = {
            "prompt": prompt,
            "text": self.tokenizer.detokenize(generated.tokens),
            "tokens": generated.tokens,
            "length": len(generated.tokens),
            "finished": generated.finished,
        }
        if generated.logits is not None:
            row["logits"] = generated.logits
        return row


def _stop_in_batch(stop: StopCondition, batch: list[int], row: int, tokens: list[int]) -> bool:
    """The decoder numbers rows within its batch; `stop` knows prompts by their index."""
    return stop(batch[row], tokens)


def write_jsonl(path: str, rows: list[dict[str, Any]]) -> None:
    with atomic_path(path) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")


def _show(rows: list[dict[str, Any]], with_prompt: bool) -> None:
    for i, row in enumerate(rows):
        end = "" if row["finished"] else " ..."
        print(f"--- sample {i + 1}/{len(rows)} ({row['length']} tokens) ---", flush=True)
        print((row["prompt"] if with_prompt else "") + row["text"] + end, flush=True)


def run_unconditional(gen: TextGenerator, args: TextgenArgs) -> list[dict[str, Any]]:
    results = gen.complete([[] for _ in range(args.num_samples)])
    rows = [gen.record("", g) for g in results]
    if is_rank0():
        write_jsonl(args.sample_output_file, rows)
        _show(rows, with_prompt=False)
        get_logger().info("wrote %d samples to %s", len(rows), args.sample_output_file)
    return rows


def run_input_file(gen: TextGenerator, args: TextgenArgs) -> list[dict[str, Any]]:
    prompts = args.prompts()
    results = gen.complete([gen.tokenizer.tokenize(p) for p in prompts])
    rows = [gen.record(p, g) for p, g in zip(prompts, results)]
    if is_rank0():
        write_jsonl(args.sample_output_file, rows)
        _show(rows, with_prompt=True)
        get_logger().info("wrote %d completions of %s to %s", len(rows), args.sample_input_file,
                          args.sample_output_file)
    return rows


def run_interactive(gen: TextGenerator, read_prompt: Callable[[], str | None],
                    show: Callable[[str], None]) -> int:
    """Until `read_prompt` (called on rank 0 only) returns None; returns the number of prompts."""
    count = 0
    while True:
        box: list[str | None] = [read_prompt() if is_rank0() else None]
        if dist.is_initialized():
            dist.broadcast_object_list(box, src=0)
        prompt = box[0]
        if prompt is None:
            return count
        if not prompt.strip():
            continue
        # every replica completes the prompt (they have nothing else to do); rank 0 shows it
        mine = {count: gen.tokenizer.tokenize(prompt)}
        generated = gen.complete_local(mine)[count]
        if is_rank0():
            show(gen.tokenizer.detokenize(generated.tokens))
        count += 1
