"""Where checkpoints are saved and loaded from, when a run saves, and which checkpoints it keeps.
GPT-NeoX files these keys under ``NeoXArgsTraining`` (``iteration``, the step to load, under
``NeoXArgsOther``).

Declared here, beside the checkpoint manager that reads them; the one argument object
(``NeoXArgs``) is composed of this class, and the trainer hands
:meth:`megatron.checkpointing.manager.CheckpointManager.from_config` that object (typed as
:class:`CheckpointArgs`). Besides GPT-NeoX's keys: time-based temporary checkpoints
(``save_interval``), step-based retention (``keep``), ``load_checkpoint`` and ``initialize_from``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from megatron.config_schema import ArgGroup
from megatron.object_store import S3_MIN_PART


class CheckpointArgs(ArgGroup):
    """The checkpoint keys of GPT-NeoX's ``NeoXArgsTraining`` group (and ``iteration`` of
    ``NeoXArgsOther``), with Deepy's retention and start-point extras."""

    save: str | None = None
    """Directory to write checkpoints to; unset disables saving."""

    config_files: dict[str, str] | None = None
    """The run's config files (name -> text), stored with checkpoints; filled in by the loader."""

    load: str | None = None
    """Directory to resume or start from; the latest committed checkpoint in it is loaded. Anything
    else there (a GPT-NeoX or Hugging Face checkpoint, only incomplete saves, other files) is an
    error naming what was found; a missing or empty `load` is accepted only when it is also `save`."""

    load_checkpoint: bool = True
    """Resume (or fine-tune) from `load`; false starts fresh even when `load` is set (Deepy's own
    key: the explicit way to ignore a `load` directory)."""

    checkpoint_validation_with_forward_pass: bool = False
    """After saving, reload the checkpoint and check one forward pass gives the same logits."""

    checkpoint_scale: Literal["linear", "log"] = "linear"
    """Spacing of saves: every checkpoint_factor steps (linear) or at powers of checkpoint_factor
    (log)."""

    checkpoint_factor: int | float | None = Field(None, gt=0)
    """Save interval in steps (linear), or the base of the powers (log)."""

    extra_save_iters: list[int] | None = None
    """Additional steps at which to save a checkpoint."""

    no_save_rng: bool = False
    """Leave random-number-generator state out of checkpoints."""

    no_save_optim: bool = False
    """Leave the optimizer and LR-scheduler state out of checkpoints (the ZeRO optimizer files, the optimizer and
    lr_scheduler entries of the model-states file, experts' moments): smaller, the module's weights only. Such a
    checkpoint starts runs from its weights (finetune, initialize_from) or resumes with no_load_optim; an exact
    resume, or a load at another layout, is refused. Not with ZeRO stage 3, which keeps the weights in those files."""

    no_load_optim: bool = False
    """Do not restore optimizer state when loading."""

    no_load_rng: bool = False
    """Do not restore random-number-generator state when loading."""

    finetune: bool = False
    """Load only the weights and start from step 0 with fresh optimizer and data position."""

    keep_last_n_checkpoints: int | None = Field(None, ge=1)
    """Delete older step checkpoints so at most this many stay on disk; unset keeps all."""

    iteration: int | None = Field(None, ge=0)
    """Current optimizer step; updated while training, stored in checkpoints."""

    s3_path: str | None = None
    """Also upload every committed checkpoint to this object-store prefix, as GPT-NeoX does: rank 0 uploads
    <save>/<tag>/... to <s3_path>/<basename of save>/<tag>/... (so `save` is a directory every node shares);
    the bucket's copies are never deleted."""

    s3_chunk_size: int = Field(104857600, ge=S3_MIN_PART)
    """Part size in bytes of the multipart uploads (S3's smallest part is 5 MiB)."""

    # ---- Deepy extras (not in GPT-NeoX) ----

    async_save: bool = False
    """Write checkpoints in the background (Megatron's --async-save): the loop stops only to copy the state into
    host memory; a thread writes the files while training goes on, and the checkpoint is committed (marker,
    `latest`, uploads) only once every rank's files are written and verified. One save at a time: the next save,
    a stop and the end of the run wait for it."""

    checkpoint_staging_dir: str | None = None
    """Local directory for the checkpoints of a `save`/`load` in object storage (s3://...): written here, then
    uploaded; downloaded here before loading. Default $XDG_CACHE_HOME (or ~/.cache)/deepy/staging/<scheme>/<bucket>/<prefix>;
    one per node (not a shared file system)."""

    save_interval: str | int | None = None
    """Also save a temporary checkpoint at this wall-clock interval (`15min`, `1h`, or seconds); it
    is replaced by the next one. Rank 0's clock decides, after the step in which the interval since
    the last save elapsed (on GPUs after the next one: the ranks agree without waiting for the device)."""

    keep: list[dict[str, int | None]] | None = None
    """Step-based retention policy as a list of {every, until} rules, e.g. [{every: 1000, until:
    10000}, {every: 5000}] (Levanter)."""

    initialize_from: str | None = None
    """Checkpoint to take the starting weights from, without its optimizer state or step."""

    initialize_from_hf: str | None = None
    """A local transformers model directory to start from (weights only, step 0), while `save` holds no
    checkpoint of the run's own: deepy.py converts it before launch into <save>/hf_import (the import tool,
    at the run's split and dtype) and sets initialize_from to it. Deepy extra (Levanter's initialize_from_hf)."""

    neox_qkv_order: Literal["per_rank", "per_query_head"] | None = None
    """Row order of the fused QKV weights of a grouped-query GPT-NeoX checkpoint named by `load` or
    `initialize_from` (its files cannot tell): per_rank = [Q; K; V] of each tensor-parallel rank
    (GPT-NeoX since Nov 2024 and its HF converter since May 2025), per_query_head = each query head's
    rows with its slice of K and V (earlier GPT-NeoX). Required for such a checkpoint; Deepy's own
    checkpoints record their order, and the key must then be unset or agree."""

    @field_validator("keep")
    @classmethod
    def _keep_rules_shape(
        cls, value: list[dict[str, int | None]] | None
    ) -> list[dict[str, int | None]] | None:
        """Each rule is ``{every: N}`` or ``{every: N, until: M}`` with positive steps.

        Checked here rather than when the first checkpoint is due, so a typo such as ``evry``
        fails at launch instead of hours into the run.
        """
        for rule in value or []:
            unknown = sorted(set(rule) - {"every", "until"})
            if unknown or not isinstance(every := rule.get("every"), int) or every < 1:
                raise ValueError(
                    f"rule {rule!r} should be {{every: N}} or {{every: N, until: M}} with N >= 1"
                )
            until = rule.get("until")
            if until is not None and until < 1:
                raise ValueError(f"rule {rule!r}: until must be a positive step")
        return value
