"""Changing the parallel layout between save and load, through DeepSpeed's universal checkpoints.

A checkpoint records the layout it was written at. When the loading run differs in tp, pp, dp, ZeRO
stage or pipeline wrapping, rank 0 converts the checkpoint into a universal one (one full, unsharded
tensor per parameter and optimizer state, LoRA's frozen base included) while the other ranks wait; then
every rank loads it and cuts each tensor for the new layout. The conversion is written where the loading
run writes, never into the source (which may be read-only, or another run's), see :func:`conversion_dir`:

* ``<save>/<tag>_universal`` for the run's own checkpoint (``load`` is ``save``), deleted with it;
* ``<save>/<tag>_universal_of_<key>`` for a checkpoint elsewhere, deleted once the run has committed a
  checkpoint of its own (a restart resumes that one);
* a temporary directory without ``save``, deleted after loading.

It is committed with the same marker protocol as a checkpoint and reused by later loads.

Who does what (``reshard.py`` holds Deepy's parts):

=====================  ==============================================  ==========================================
                       ZeRO 1, 2, 3 (and the bf16 optimizer)           ZeRO 0 (fp32: a torch optimizer)
=====================  ==============================================  ==========================================
saved -> universal     DeepSpeed's ``ds_to_universal`` (a child        Deepy: the shards go through DeepSpeed's
                       process)                                        own merge step (``zero0_to_universal``)
universal -> loading   DeepSpeed's universal loader                    Deepy: ``load_into_torch_optimizer``
=====================  ==============================================  ==========================================

In between, ``reshard.complete_for_any_target`` names every parameter for both the plain and the
pipeline model, so pipeline (``pipe_parallel_size >= 1``) and plain (``0``) checkpoints load into
each other, and fits the padded vocabulary to the loading run's tp. Without ZeRO a change of dp alone
needs no conversion at all: every data-parallel rank holds the whole optimizer.

RNG streams are restored only when tp, pp and dp are unchanged (each rank's streams follow its share
of the work); otherwise torch's and the tensor-parallel stream are seeded from ``seed + iteration``
(``CheckpointHooks``). docs/resume_layouts.md has the whole table.

Not covered (refused at load with what to do, before any weight changes): fp16/bf16 runs without ZeRO on the
loading side and fp16 runs without ZeRO on the saving side (DeepSpeed's fp16/bf16 optimizers keep
their own layout there), ZeRO-3 with tensor parallelism on either side, and mixture-of-experts
models across ZeRO 0/3 or pipeline wrapping (their expert shards are Deepy's own, written per
data-parallel rank; ZeRO 1-2 layout changes of MoE models work).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from deepspeed.checkpoint import constants as ds

from megatron.checkpointing import commit, reshard
from megatron.checkpointing.layout import Layout, check_convertible, needs_universal  # noqa: F401  (their home)
from megatron.checkpointing.neox import NeoxNames
from megatron.errors import CheckpointError
from megatron.model.layer_sharing import shared_owners
from megatron.model.partitioning import tp_partition_patterns

if TYPE_CHECKING:
    from megatron.model.config import GPTConfig

log = logging.getLogger("deepy.checkpoint")  # a child of the run logger: rank 0 speaks

UNIVERSAL_SUFFIX = "_universal"


def universal_dir(ckpt_dir: Path) -> Path:
    """``<save>/<tag>_universal``: the conversion of a run's own checkpoint, beside it."""
    return ckpt_dir.with_name(ckpt_dir.name + UNIVERSAL_SUFFIX)


TEMPORARY_ROOT = "deepy_universal"
"""Folder under the system's temporary directory for conversions of runs without ``save``."""


def conversion_dir(ckpt_dir: Path, save_dir: Path | None) -> Path:
    """Where the universal checkpoint of ``ckpt_dir`` goes for a run that saves to ``save_dir`` (module docstring).

    A checkpoint outside ``save`` gets a name keyed by its path and commit time, so a cached conversion is
    never mistaken for another source's, nor for the same tag rewritten since.
    """
    if save_dir is not None and ckpt_dir.parent.resolve() == save_dir.resolve():
        return universal_dir(ckpt_dir)
    marker = commit.read_commit_marker(ckpt_dir)
    identity = f"{ckpt_dir.resolve()}|{marker.time if marker else ''}"
    key = hashlib.sha1(identity.encode("utf-8")).hexdigest()[:12]
    root = save_dir if save_dir is not None else Path(tempfile.gettempdir()) / TEMPORARY_ROOT
    return root / f"{ckpt_dir.name}{UNIVERSAL_SUFFIX}_of_{key}"


def foreign_conversions(save_dir: Path) -> list[Path]:
    """The conversions of checkpoints outside ``save_dir`` that this run wrote into it."""
    if not save_dir.is_dir():
        return []
    return sorted(p for p in save_dir.iterdir() if p.is_dir() and f"{UNIVERSAL_SUFFIX}_of_" in p.name)


def prepare_universal(ckpt_dir: Path, meta: dict[str, Any], vocab_rows: int | None, target: Path) -> Path:
    """The universal checkpoint of ``ckpt_dir`` in ``target`` (see :func:`conversion_dir`), converted once and
    made loadable by any target layout (rank 0 only; the other ranks wait). ``meta``: the checkpoint's
    ``deepy_meta.json``. Nothing is written into ``ckpt_dir``."""
    saved = Layout.from_dict(meta["layout"])
    info = meta.get("universal_info") or {}
    if not commit.is_committed(target):
        if target.exists():
            shutil.rmtree(target)  # a conversion killed half-way
        target.parent.mkdir(parents=True, exist_ok=True)
        if reshard.has_zero_files(ckpt_dir):
            convert_to_universal(ckpt_dir, target, meta)
        else:
            if not info:
                raise CheckpointError(f"{ckpt_dir} records no universal_checkpoint_info: it cannot change layout")
            log.info("converting %s (saved without ZeRO) to a universal checkpoint for the new layout", ckpt_dir)
            reshard.zero0_to_universal(ckpt_dir, target, saved.tp, saved.pp, saved.pipeline, info,
                                      NeoxNames.from_stored(meta.get("args") or {}))
            reshard.write_frozen_parameters(ckpt_dir, target, meta)
            marker = commit.read_commit_marker(ckpt_dir)
            commit.write_commit_marker(target, marker or commit.CommitInfo(step=-1, kind="step", time=time.time()))
    args = meta.get("args") or {}
    tied = not args.get("no_weight_tying", False) and args.get("train_impl") != "rm"
    shared = shared_owners(int(args["num_layers"]), args.get("num_unique_layers"),
                           str(args.get("param_sharing_style") or "grouped"))
    reshard.complete_for_any_target(target, num_layers=int(args["num_layers"]), tied=tied, vocab_rows=vocab_rows,
                                    vocab_patterns=list(info.get("vocabulary_parameter_patterns", [])), info=info,
                                    shared=shared)
    return target


def convert_to_universal(ckpt_dir: Path, target: Path, meta: dict[str, Any], timeout_s: float = 3600.0) -> Path:
    """Run ``ds_to_universal`` on ``ckpt_dir`` (a ZeRO 1-3 checkpoint), writing ``target`` (once: later calls
    reuse the committed result); LoRA's frozen base is added from the model files.

    It runs in a child process: the converter forks worker pools and loads every shard, neither of
    which should happen inside a rank that holds a process group.
    """
    if commit.is_committed(target):
        return target
    if target.exists():
        shutil.rmtree(target)  # a conversion killed half-way
    source = _converter_input(ckpt_dir, target)
    cmd = [
        sys.executable, "-m", "megatron.checkpointing.convert",
        "--input_folder", str(source),
        "--output_folder", str(target),
        "--inject_missing_state",
        # our pattern list is per model family; a tied model has no output_layer to match
        "--no_strict",
        "--num_extract_workers", "1",
        "--num_merge_workers", "1",
    ]  # fmt: skip
    log.info("converting %s to a universal checkpoint for the new layout", ckpt_dir)
    started = time.monotonic()
    repo = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH", "")) if p)}
    try:
        returncode, output = _run_showing_phases(cmd, env, timeout_s)
    finally:
        if source != ckpt_dir:
            shutil.rmtree(source, ignore_errors=True)
    if returncode != 0:
        tail = "\n".join(output[-15:])
        raise CheckpointError(f"converting {ckpt_dir} to a universal checkpoint failed:\n{tail}")
    # the converter points latest_universal beside its output at it; our loads name the directory
    # explicitly, and a stray pointer would only confuse DeepSpeed-native tools
    stray = target.parent / "latest_universal"
    if stray.exists():
        stray.unlink()
    reshard.write_frozen_parameters(ckpt_dir, target, meta)
    info = commit.read_commit_marker(ckpt_dir)
    commit.write_commit_marker(target, info or commit.CommitInfo(step=-1, kind="step", time=time.time()))
    log.info("universal conversion done in %.1fs: %s", time.monotonic() - started, target)
    return target


def _converter_input(ckpt_dir: Path, target: Path) -> Path:
    """The folder to hand ``ds_to_universal``: ``ckpt_dir`` itself, or for a pipeline checkpoint in
    GPT-NeoX's layout a folder of links to its files plus ``layer_01-*`` names, beside ``target`` (not
    in the source's directory).

    DeepSpeed's converter refuses a pipeline checkpoint without ``layer_01-*`` files (the first block
    in Megatron-DeepSpeed's numbering), while GPT-NeoX's layer 1 has no parameters and so no file. It
    only lists the layer files' names (the weights come from the ZeRO shards), so each missing name
    links to the layer-0 file of the same tp rank.
    """
    layer_files = sorted(ckpt_dir.glob("layer_*-model_*-model_states.pt"))
    if not layer_files or any(p.name.startswith("layer_01-") for p in layer_files):
        return ckpt_dir
    staged = target.with_name(target.name + "_input")
    if staged.exists():
        shutil.rmtree(staged)
    staged.mkdir()
    for entry in ckpt_dir.iterdir():
        (staged / entry.name).symlink_to(entry.resolve(), target_is_directory=entry.is_dir())
    for first in (p for p in layer_files if p.name.startswith("layer_00-")):
        (staged / first.name.replace("layer_00-", "layer_01-", 1)).symlink_to(first.resolve())
    return staged


def _run_showing_phases(cmd: list[str], env: dict[str, str], timeout_s: float) -> tuple[int, list[str]]:
    """Run the converter, relaying its phase lines ("*** 1. Extracting ZeRO fragments") as progress
    and keeping its output for the error message; its tqdm bars (carriage returns) are not relayed."""
    started = time.monotonic()
    lines: list[str] = []
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    timer = threading.Timer(timeout_s, proc.kill)  # a hung converter must not hang the run
    timer.start()
    try:
        assert proc.stdout is not None
        for raw in proc.stdout:
            line = raw.rstrip("\n").split("\r")[-1]
            lines.append(line)
            if line.startswith("***"):
                log.info("universal conversion (%.0fs): %s", time.monotonic() - started, line.strip("* ").rstrip(". "))
        returncode = proc.wait()
    finally:
        timer.cancel()
    if returncode != 0 and time.monotonic() - started >= timeout_s:
        lines.append(f"(stopped after {timeout_s:.0f}s)")
    return returncode, lines


def universal_checkpoint_info(config: GPTConfig, tp: int) -> dict[str, Any]:
    """DeepSpeed's ``universal_checkpoint_info`` for our model, from its TP partition patterns.

    It tells ``ds_to_universal`` how to glue tensor-parallel shards back into full tensors:
    row-parallel weights along dim 1, vocabulary matrices along dim 0 (padding rows kept), fused
    tensors (QKV, gated MLP) section by section, and everything else is replicated (take one copy).
    DeepSpeed matches these with ``re.match`` (anchored at the start) while our patterns are
    searched anywhere in the name, hence the ``.*(?:...)`` wrapping.
    """
    def anywhere(pattern: str) -> str:
        return f".*(?:{pattern})"

    patterns = tp_partition_patterns(config)
    row: list[str] = []
    vocab: list[str] = []
    sub_params: list[dict[str, Any]] = []
    shard_widths: dict[str, list[list[int]]] = {}
    for pattern, part in patterns.items():
        if part.vocabulary:
            vocab.append(anywhere(pattern))
        elif part.dim == 1:
            row.append(anywhere(pattern))
        elif part.sections is not None and len(part.sections) > 1:
            key = anywhere(pattern)
            # -1: the other dimension (hidden size for weights, 1 for biases) is inferred
            sub_params.append({"patterns": [key], "shape": (tuple(part.sections), -1), "partition_dim": 0})
            shard_widths[key] = [[size // tp] * tp for size in part.sections]
    replicated = "^(?!" + "|".join(anywhere(p) for p in patterns) + ").*$"
    return {
        ds.UNIVERSAL_CHECKPOINT_VERSION_KEY: ds.UNIVERSAL_CHECKPOINT_VERSION_VALUE,
        "original_vocab_size": int(config.vocab),
        ds.VOCABULARY_PARAMETER_PATTERNS: vocab,
        ds.PARAMETER_WITH_ROW_PARALLELISM_PATTERNS: row,
        ds.PARAMETER_WITH_SUB_PARAMS: sub_params,
        ds.SUB_PARAM_SHARD_WIDTHS: shard_widths,
        ds.TP_REPLICATED_PARAMETER_PATTERNS: [replicated],
    }
