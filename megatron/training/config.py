"""The training loop's keys: how long to train, how often to evaluate and stop, the overflow guard and
read-ahead. GPT-NeoX files its keys among these under ``NeoXArgsTraining``; how the model is built for
training (compiled blocks, ZeRO-3 construction) is the engine's (``megatron/engine/config.py``).

Declared here, beside the loop that reads them (``megatron/training/pretrain.py``, ``loop.py``); the one
argument object (``NeoXArgs``) is composed of this class. The loop also reads
keys that several components share and that are declared with their owners (``seq_length`` and
``precision`` with the model, ``seed`` with the process keys, the batch sizes with DeepSpeed's):
:class:`TrainingRun` holds the loop's keys (its own instance of :class:`TrainingLoopArgs`) with those
values, resolved once (``RunConfig.training``).
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import Field

from megatron.config_schema import ArgGroup
from megatron.data.batch import RankBatch
from megatron.errors import ConfigError

def last_iteration(train_iters: int, samples_cap: int | None, global_batch: int) -> int:
    """Where the run stops: ``train_iters``, or earlier where ``max_train_epochs`` of data end (the last
    whole global batch within them). Levanter's loop ends when its loader runs out
    (trainer.py:418-428@9263f81e) while its LR schedule keeps spanning num_train_steps; its loader pads
    a final partial batch with zero-loss examples (data/loader.py:322-335@9263f81e), which Deepy does
    not build, so a remainder smaller than one global batch is left unread."""
    if samples_cap is None:
        return train_iters
    last = min(train_iters, samples_cap // global_batch)
    if last < 1:
        raise ConfigError(f"max_train_epochs: its epochs hold {samples_cap} samples, fewer than one global batch "
                          f"({global_batch}); raise max_train_epochs or lower train_batch_size")
    return last


class TrainingLoopArgs(ArgGroup):
    """Deepy's own group: the loop's keys, which GPT-NeoX files under ``NeoXArgsTraining``."""

    train_iters: int | None = Field(None, ge=0)
    """Number of optimizer steps to train for."""

    train_epochs: int | None = Field(None, ge=1)
    """Train for this many passes over the data instead of giving train_iters."""

    max_train_epochs: int | None = Field(None, ge=1)
    """Stop early once the train split has been read this many times over (in whole global batches),
    even before train_iters, whose length the LR schedule keeps (Levanter's top-level epoch)."""

    eval_iters: int = Field(100, ge=0)
    """Batches per evaluation."""

    eval_micro_batch_size_per_gpu: int | None = Field(None, ge=1)
    """Samples per data-parallel rank in each evaluation batch, which then holds this x the data-parallel
    ranks samples with no accumulation (Levanter's per_device_eval_parallelism); unset: each evaluation
    batch is a training global batch (train_batch_size), as in GPT-NeoX."""

    eval_interval: int = Field(1000, ge=1)
    """Evaluate on the validation split every this many steps."""

    char_level_ppl: bool = False
    """Also report the character-level perplexity of each evaluation, eval/lm_loss_char_lvl_ppl (and
    test/...): exp(lm_loss x tokens / characters), the tokens and the characters the tokenizer's detokenize
    gives of the evaluated rows' text (seq_length + 1 tokens a row, as GPT-NeoX counts), so it compares
    across tokenizers; costs a detokenize of every evaluated row."""

    num_workers: int = Field(2, ge=0)
    """Training micro-batches read ahead of the step by a background thread per rank; 0 reads each
    when the step asks for it."""

    exit_interval: int | None = Field(None, ge=1)
    """Stop cleanly after this many steps (for jobs limited by wall time)."""

    # ---- Deepy extras (not in GPT-NeoX) ----

    max_consecutive_overflows: int = Field(50, ge=1)
    """Abort an fp16 run after this many optimizer steps in a row skipped for overflow, instead of
    silently training nothing."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainingRun:
    """What the loop reads: its own keys (``loop``, its own instance of :class:`TrainingLoopArgs`) and
    the values of keys other components declare, resolved once above (``RunConfig.training``)."""

    loop: TrainingLoopArgs
    """The loop's keys: length, evaluation and exit intervals, the overflow guard, read-ahead."""
    seq_length: int
    """Tokens per sample (the model's key)."""
    precision: str | None
    """The compute precision (the model's key: ``bfloat16``, ``fp16``, ``fp32`` or unset)."""
    seed: int
    """The run's seed (the process keys')."""
    batch: RankBatch
    """Micro batch and accumulation (DeepSpeed's keys, solved before launch)."""
