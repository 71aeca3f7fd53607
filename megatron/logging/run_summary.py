"""What a training run says about itself before its first step and after its last one.

The header is the Hugging Face Trainer's "***** Running training *****" block, for a run split over
ranks: the model (all parameters, and how many train: a LoRA run names its adapters), the layout, the
batch (sequences, tokens per step), the schedule (steps, tokens, epochs over the train split) and
where the metrics and checkpoints go. The summary closes the run: steps, wall time, tokens, average
tokens/s (and MFU where the device's peak is known), the last losses, the newest checkpoint and the
metrics file. Both are plain functions of small frozen records, so the tests read them without a run.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron.logging.heartbeats import restarts_so_far

from megatron.logging.progress import format_duration


@dataclass(frozen=True, kw_only=True, slots=True)
class RunFacts:
    """Everything the header states; known once the model is built and the checkpoint loaded."""

    run_name: str
    metrics_dir: str | None
    """``<log_dir>/<run name>``: the run's one directory (metrics.jsonl, deepy_config.json); None without log_dir."""
    parameters: int
    non_embedding_parameters: int
    trainable_parameters: int
    adapters: bool
    """LoRA: the trainable parameters are its adapters (and a reward head), the rest is frozen."""
    engine: str
    """``pipeline`` (DeepSpeed's PipelineModule) or ``plain``."""
    world_size: int
    dp: int
    tp: int
    pp: int
    cp: int
    zero_stage: int
    precision: str
    micro_batch: int
    accumulation: int
    global_batch: int
    seq_length: int
    rows_per_sample: int = 1
    """Sequences per sample: 2 for a DPO pair (chosen and rejected) or KTO's completion and its mismatched twin."""
    tokens_per_step: int
    train_iters: int
    start_iteration: int
    samples_at_end: int
    """Samples read after step ``train_iters``: those a resumed run read before (its checkpoint's consumed
    samples, at the batch sizes it had) plus this launch's steps' batches."""
    tokens_at_end: int
    """Tokens of ``samples_at_end``, counted as :attr:`samples_at_end` is (a micro-batch change between
    launches changes the tokens per step of the steps to go only)."""
    split_tokens: int | None
    """Tokens of one pass over a packed train split (None: not packed, or the data cannot say)."""
    split_documents: int | None
    """Documents of the train split (None: the data cannot say, e.g. dummy data); without
    ``split_tokens`` a sample is one document, so epochs count samples."""
    eval_interval: int | None
    eval_iters: int
    save: str | None


def split_size(dataset: Any) -> tuple[int | None, int | None]:
    """(tokens of one pass over a packed split, documents) of a train dataset, as far as it can say:
    a packed split's documents are its token stream, an unpacked one (SFT ``pack_impl``, pairs, rewards)
    reads one document per sample; blends add their parts up."""
    parts = getattr(dataset, "datasets", None)
    if parts is not None:  # a blend
        sizes = [split_size(part) for part in parts]
        tokens = [t for t, _ in sizes]
        docs = [d for _, d in sizes]
        return (sum(t for t in tokens if t is not None) if all(t is not None for t in tokens) else None,
                sum(d for d in docs if d is not None) if all(d is not None for d in docs) else None)
    inner = getattr(dataset, "inner", None)
    if inner is not None:
        return split_size(inner)
    doc_sizes = getattr(dataset, "sizes", None)
    if doc_sizes is None:
        return None, None
    packed = getattr(dataset, "pack_impl", "packed") == "packed"
    return (int(doc_sizes.sum()) if packed else None), len(doc_sizes)


def _samples(f: RunFacts) -> str:
    if f.rows_per_sample == 1:
        return f"{_count(f.global_batch)} sequences"
    return f"{_count(f.global_batch)} samples ({_count(f.global_batch * f.rows_per_sample)} sequences)"


def _count(n: int) -> str:
    return f"{n:,}"


def _share(part: int, whole: int) -> str:
    return f"{100.0 * part / whole:.2f}%" if whole else "n/a"


def header_lines(f: RunFacts) -> list[str]:
    """The header block (no trailing empty line); see :class:`RunFacts`."""
    share = _share(f.trainable_parameters, f.parameters)
    trainable = (f"{_count(f.trainable_parameters)} trainable (LoRA adapters, {share})" if f.adapters else
                 "all trainable" if f.trainable_parameters == f.parameters else
                 f"{_count(f.trainable_parameters)} trainable")
    layout = f"{f.world_size} rank{'s' if f.world_size != 1 else ''}: data {f.dp} x tensor {f.tp} x pipeline {f.pp}"
    if f.cp > 1:
        layout += f" x context {f.cp}"
    steps_left = max(f.train_iters - f.start_iteration, 0)
    schedule = f"{_count(f.train_iters)} steps"
    if f.start_iteration:
        schedule += f" (resuming after step {_count(f.start_iteration)}: {_count(steps_left)} to go)"
    schedule += f", {_count(f.tokens_at_end)} tokens"
    if f.split_tokens:
        epochs = f.tokens_at_end / f.split_tokens
        schedule += (f" = {epochs:.2f} epochs of the train split ({_count(f.split_tokens)} tokens"
                     + (f" in {_count(f.split_documents)} documents)" if f.split_documents else ")"))
    elif f.split_documents:
        epochs = f.samples_at_end / f.split_documents
        schedule += f" = {epochs:.2f} epochs of the train split ({_count(f.split_documents)} documents, one per sample)"
    lines = [
        f"run {f.run_name}" + (f": metrics and config in {f.metrics_dir}/" if f.metrics_dir else
                               ": no metrics.jsonl (log_dir is not set)"),
        f"  model       {_count(f.parameters)} parameters ({_count(f.non_embedding_parameters)} without embeddings), "
        f"{trainable}; {f.engine} engine",
        f"  layout      {layout}; ZeRO {f.zero_stage}; {f.precision}",
        f"  batch       {_samples(f)} x {_count(f.seq_length)} tokens = "
        f"{_count(f.tokens_per_step)} tokens per step ({f.micro_batch} per rank x {f.accumulation} accumulation "
        f"x {f.dp} data-parallel)",
        f"  schedule    {schedule}",
    ]
    where = []
    if f.eval_interval and f.eval_iters:
        where.append(f"evaluation every {_count(f.eval_interval)} steps ({f.eval_iters} batches)")
    where.append(f"checkpoints in {f.save}/" if f.save else "no checkpoints (save is not set)")
    lines.append("  output      " + "; ".join(where))
    return lines


@dataclass(frozen=True, kw_only=True, slots=True)
class RunOutcome:
    """What the summary states; gathered by the monitor while the run goes."""

    first_iteration: int
    """The iteration this launch started after (0 for a fresh run)."""
    last_iteration: int
    stop_reason: str
    wall_seconds: float
    """From the first step to the last one, evaluations and checkpoints included."""
    tokens: int
    """Tokens trained on by this launch."""
    world_size: int
    flops_per_token: float
    peak_tflops: float | None
    last_row: Mapping[str, Any]
    """The newest value of every metric logged (train/lm_loss, eval/lm_loss, ...)."""
    save: str | None
    metrics_file: str | None


def _latest_tag(save: str) -> str | None:
    try:
        return (Path(save) / "latest").read_text().strip() or None
    except OSError:
        return None


def summary_lines(o: RunOutcome) -> list[str]:
    """The closing block: ``done: ...`` then the losses, the checkpoint and the metrics file."""
    steps = o.last_iteration - o.first_iteration
    seconds = max(o.wall_seconds, 1e-9)
    rate = o.tokens / seconds
    speed = f"{rate:,.0f} tokens/s"
    if o.peak_tflops:
        mfu = rate / max(o.world_size, 1) * o.flops_per_token / 1e12 / o.peak_tflops
        speed += f", MFU {mfu:.1%}"
    lines = [f"done: {_count(steps)} steps ({o.first_iteration + 1 if steps else o.first_iteration}-"
             f"{o.last_iteration}, {o.stop_reason}) in {format_duration(o.wall_seconds)}: "
             f"{_count(o.tokens)} tokens, {speed} on average"]
    losses = [f"{label} {o.last_row[key]:.4f}" for key, label in
              (("train/lm_loss", "train loss"), ("eval/lm_loss", "eval loss"), ("test/lm_loss", "test loss"),
               ("eval/rewards/accuracy", "eval reward accuracy"), ("eval/rm/accuracy", "eval accuracy"))
              if isinstance(o.last_row.get(key), (int, float))]
    if losses:
        lines.append("  last        " + ", ".join(losses))
    if o.save:
        tag = _latest_tag(o.save)
        lines.append(f"  checkpoint  {Path(o.save) / tag if tag else o.save + ' (none committed yet)'}")
    restarts = restarts_so_far()
    if restarts:
        last = restarts[-1]
        lines.append(f"  restarts    {len(restarts)} (max_restarts; the last after step {last.get('step')}: "
                     f"{last.get('reason')})")
    if o.metrics_file:
        lines.append(f"  metrics     {o.metrics_file}")
    return lines
