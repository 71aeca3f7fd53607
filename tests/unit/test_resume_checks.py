"""Before launch, ``deepy.py`` reads the arguments recorded by the checkpoint the ranks will load and refuses
every mismatch the ranks would refuse only after launch (issue 30 item 10), each naming the key and file:line;
a resume at another data-parallel size keeps the global batch or is refused by name.

The checkpoints here are save directories with what a Deepy save writes besides tensors, which is all these
checks read: ``deepy_meta.json`` (the recorded arguments, built as the trainer builds them: the resolved
arguments of a real config plus the padded vocabulary and ``train_iters``), the ``COMMITTED`` marker and
``latest`` (written by ``megatron.checkpointing.commit``).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from megatron.checkpointing import commit
from megatron.config_rules import Device
from megatron.errors import ConfigError
from megatron.neox_arguments.arguments import NeoXArgs
from megatron.neox_arguments.derived import finalize
from megatron.neox_arguments.resolved import ResolvedConfig

REPO = Path(__file__).resolve().parents[2]
CPU = Device(cuda=False, fp16_supported=False)

BASE: dict[str, Any] = {
    "num_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "seq_length": 32,
    "train_micro_batch_size_per_gpu": 4,
    "train_iters": 100,
    "lr": 1e-3,
    "use_dummy_dataset": True,
    "tokenizer_type": "CharLevelTokenizer",
}


def resolved(script: str = "train.py", **values: Any) -> ResolvedConfig:
    """Args as if read from ``cfg.yml``, one key per line in the order given, launched with ``script``."""
    merged = {**BASE, **values}
    provenance = {key: f"cfg.yml:{line}" for line, key in enumerate(merged, start=1)}
    return ResolvedConfig(args=NeoXArgs(**merged), provenance=provenance, entry_point=script)


def line(config: ResolvedConfig, key: str) -> str:
    return f"({config.provenance[key]})"


def saved_checkpoint(save: Path, step: int = 10, world: int = 1, zero: int = 0, **values: Any) -> Path:
    """A committed checkpoint of a run of ``values`` on ``world`` ranks, as the trainer records it."""
    run = finalize(resolved(**{**values, "save": str(save), "checkpoint_factor": step}), world, device=CPU)
    args = run.args
    tp, pipe = args.model_parallel_size, args.pipe_parallel_size
    record = {**args.model_dump(mode="json"), "padded_vocab_size": 512, "train_iters": args.train_iters,
              "iteration": step}
    layout = {"tp": tp, "pp": max(pipe, 1), "dp": world // (tp * max(pipe, 1)), "zero_stage": zero,
              "pipeline": pipe >= 1, "replicas": 1}
    tag = save / commit.tag_for(step)
    tag.mkdir(parents=True)
    meta = {"format": 2, "iteration": step, "consumed_samples": step * args.train_batch_size, "kind": "step",
            "layout": layout, "world_size": world, "extra": {}, "universal_info": None, "args": record}
    (tag / "deepy_meta.json").write_text(json.dumps(meta))
    commit.write_commit_marker(tag, commit.CommitInfo(step, "step", time.time()))
    commit.write_latest(save, tag.name)
    return tag


def refused(config: ResolvedConfig, world: int = 1) -> str:
    with pytest.raises(ConfigError) as err:
        finalize(config, world, device=CPU)
    return err.value.message


def make_dataset(prefix: Path, documents: int, tokens: int) -> str:
    import numpy as np

    from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder

    builder = MMapIndexedDatasetBuilder(str(prefix) + ".bin", np.uint16)
    for i in range(documents):
        builder.add_item(np.arange(tokens) % 100 + i % 7)
        builder.end_document()
    builder.finalize(str(prefix) + ".idx")
    return str(prefix)


LORA = {"lora_r": 4, "lora_alpha": 8.0, "lora_target_modules": ["query_key_value", "dense"]}


def test_each_mismatch_the_ranks_refused_after_launch_is_refused_before_it(tmp_path: Path) -> None:
    """Issue 30 item 10, one by one: each is a ConfigError (exit 2 at the entry) naming the key and its line."""
    lora = saved_checkpoint(tmp_path / "lora", **LORA).parent
    plain = saved_checkpoint(tmp_path / "plain").parent
    pipeline = saved_checkpoint(tmp_path / "pipeline", world=2, zero=1, pipe_parallel_size=1).parent

    # a changed lora_r; a LoRA checkpoint resumed without the LoRA keys; a base resumed with adapters
    config = resolved(load=str(lora), **{**LORA, "lora_r": 8})
    message = refused(config)
    assert f"lora_r=8 {line(config, 'lora_r')}" in message and "was trained with lora_r 4" in message
    message = refused(resolved(load=str(lora)))
    assert "lora_r=0 (default)" in message and "set lora_r: 4, lora_alpha: 8.0" in message
    config = resolved(load=str(plain), **LORA)
    assert f"lora_r=4 {line(config, 'lora_r')}: " in refused(config) and "initialize_from" in refused(config)
    config = resolved(load=str(lora), **{**LORA, "lora_alpha": 16.0})
    assert f"lora_alpha=16.0 {line(config, 'lora_alpha')}" in refused(config)

    # the LR schedule of the checkpoint (the ranks refused it after an 8.5 s conversion)
    config = resolved(load=str(plain), lr=2e-3)
    message = refused(config)
    assert f"lr=0.002 {line(config, 'lr')}" in message and "max_lr: checkpoint 0.001, config 0.002" in message
    assert "override_lr_scheduler: true" in message
    finalize(resolved(load=str(plain), lr=2e-3, override_lr_scheduler=True), 1, device=CPU)  # said whose wins

    # a reward model started from a language model's checkpoint at another layout
    config = resolved(initialize_from=str(pipeline), train_impl="rm", model_parallel_size=2)
    message = refused(config, world=2)
    assert f"train_impl='rm' {line(config, 'train_impl')}" in message and "a new scalar head" in message
    finalize(resolved(initialize_from=str(pipeline), train_impl="rm", pipe_parallel_size=1,
                      zero_optimization={"stage": 1}), 2, device=CPU)  # at the checkpoint's layout it starts

    # another architecture
    config = resolved(load=str(plain), hidden_size=128)
    assert f"hidden_size=128 {line(config, 'hidden_size')}: " in refused(config)
    assert "was saved with hidden_size 64" in refused(config)

    # a Hugging Face directory given to load
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "model.safetensors").write_bytes(b"")
    config = resolved(load=str(hf))
    message = refused(config)
    assert f"load='{hf}' {line(config, 'load')} is a Hugging Face model directory" in message
    assert "convert_hf_to_neox.py" in message

    # a test split too small for one sample: of 100 documents of 20 tokens, split 90/9/1 gives the test split one
    prefix = make_dataset(tmp_path / "corpus", documents=100, tokens=20)
    config = resolved(use_dummy_dataset=False, data_path=prefix, split="90,9,1", eval_iters=1)
    message = refused(config)
    assert f"split='90,9,1' {line(config, 'split')}: the test split of {prefix} (documents 99-99)" in message
    assert "holds 20 tokens, fewer than one sample of seq_length=32" in message
    finalize(resolved(use_dummy_dataset=False, data_path=prefix, split="90,5,5", eval_iters=1), 1, device=CPU)

    # an unconvertible layout change: ZeRO-3 with tensor parallelism
    zero3 = saved_checkpoint(tmp_path / "zero3", world=2, zero=3, zero_optimization={"stage": 3}).parent
    config = resolved(load=str(zero3), model_parallel_size=2, zero_optimization={"stage": 3})
    assert "combines ZeRO stage 3 with tensor parallelism" in refused(config, world=2)

    # an iteration that was never saved
    config = resolved(load=str(plain), iteration=7)
    assert f"iteration=7 {line(config, 'iteration')}: {plain} holds no committed checkpoint for iteration 7; " \
           "committed iterations: 10" in refused(config)


def test_save_holding_another_runs_checkpoints_is_refused_and_a_restart_is_not(tmp_path: Path) -> None:
    """Issue 30 item 2 (load != save with another run's global_step10 in save): refused by name before launch,
    since every save of this run would be mixed with (and replace) that run's; a restart of the same run writes on."""
    source = saved_checkpoint(tmp_path / "a", step=5).parent
    other = saved_checkpoint(tmp_path / "b", step=10).parent  # started from scratch
    config = resolved(load=str(source), save=str(other), checkpoint_factor=5)
    message = refused(config)
    assert f"save='{other}' {line(config, 'save')} already holds global_step10 of another run" in message
    mine = saved_checkpoint(tmp_path / "c", step=10, load=str(source)).parent  # this run's, restarted
    finalize(resolved(load=str(source), save=str(mine), checkpoint_factor=5), 1, device=CPU)
    config = resolved(save=str(other), checkpoint_factor=5)  # a fresh start into it
    assert "already holds committed checkpoints (10) and this run starts fresh" in refused(config)


def test_a_resume_at_another_data_parallel_size_keeps_the_global_batch(tmp_path: Path) -> None:
    """The newcomer's dp2 -> tp2 on the same two ranks: micro 4 x dp 2 = 8 became micro 4 x dp 1 = 4."""
    ckpt = saved_checkpoint(tmp_path / "dp2", world=2)  # micro 4, accumulation 1, dp 2: train_batch_size 8
    assert json.loads((ckpt / "deepy_meta.json").read_text())["args"]["train_batch_size"] == 8
    run = finalize(resolved(load=str(ckpt.parent), model_parallel_size=2), 2, device=CPU)
    args = run.args
    assert (args.train_batch_size, args.train_micro_batch_size_per_gpu, args.gradient_accumulation_steps) == (8, 4, 2)
    assert run.provenance["gradient_accumulation_steps"] == "derived" and run.deepspeed_config["train_batch_size"] == 8
    assert any("train_batch_size 8 kept, gradient_accumulation_steps 2 derived" in w for w in run.warnings)
    # the same layout, or a fresh start, keeps GPT-NeoX's micro x accumulation x dp
    assert finalize(resolved(load=str(ckpt.parent)), 2, device=CPU).args.gradient_accumulation_steps == 1
    assert finalize(resolved(model_parallel_size=2), 2, device=CPU).args.train_batch_size == 4
    # where the batch cannot be kept, refused by name
    config = resolved(load=str(ckpt.parent), model_parallel_size=2, gradient_accumulation_steps=1)
    message = refused(config, world=2)
    assert f"gradient_accumulation_steps=1 {line(config, 'gradient_accumulation_steps')}" in message
    assert "would change the global batch to 4. Set train_batch_size: 8" in message
    config = resolved(load=str(ckpt.parent), model_parallel_size=2, train_micro_batch_size_per_gpu=3)
    assert "8 is not a multiple of 3 x 1" in refused(config, world=2)
    # an explicit train_batch_size is the user's choice
    chosen = finalize(resolved(load=str(ckpt.parent), model_parallel_size=2, train_batch_size=4), 2, device=CPU)
    assert chosen.args.train_batch_size == 4


def test_generation_checks_only_what_it_reads(tmp_path: Path) -> None:
    """generate.py/eval.py read the weights whole (adapters as the checkpoint has them) and never resume or save:
    only the architecture and what `load` holds are theirs to check."""
    lora = saved_checkpoint(tmp_path / "lora", **LORA).parent
    finalize(resolved("generate.py", load=str(lora), lr=2e-3), 1, device=CPU)
    config = resolved("generate.py", load=str(lora), num_layers=3)
    assert f"num_layers=3 {line(config, 'num_layers')}" in refused(config)
    assert "does not exist" in refused(resolved("eval.py", load=str(tmp_path / "nothing")))


def test_the_command_exits_2_without_a_traceback(tmp_path: Path) -> None:
    lora = saved_checkpoint(tmp_path / "lora", **LORA).parent
    config = tmp_path / "cfg.yml"
    config.write_text("".join(f"{key}: {json.dumps(value)}\n" for key, value in {**BASE, "load": str(lora)}.items()))
    proc = subprocess.run([sys.executable, str(REPO / "deepy.py"), "--dry-run", str(REPO / "train.py"), str(config)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "lora_r=0 (default)" in proc.stderr and "Traceback" not in proc.stdout + proc.stderr
