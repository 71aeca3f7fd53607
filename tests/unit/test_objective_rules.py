"""The config rules of the post-training objectives (train_impl vs its keys and its data), checked
before launch with the key, its value and where it was set."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from megatron.checkpointing import commit
from megatron.checkpointing.config import CheckpointArgs
from megatron.errors import ConfigError
from megatron.objectives.frozen import StartingPoint, starting_point

from test_config_rules import make_dataset, ok, problems

PAIRS = {"use_dummy_dataset": False, "pos_train_data_paths": ["p"], "neg_train_data_paths": ["n"]}
KTO = {"use_dummy_dataset": False, "train_data_paths": ["t"], "train_label_data_paths": ["l"],
       "train_reward_data_paths": ["r"]}


@pytest.fixture(autouse=True)
def _datasets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Real .bin/.idx pairs for every prefix these tests name: the file checks open them before launch."""
    monkeypatch.chdir(tmp_path)
    for prefix in ("p", "n", "t", "l", "r"):
        make_dataset(tmp_path / prefix)


def test_each_objective_accepts_its_own_data() -> None:
    ok(train_impl="dpo", dpo_beta=0.2, dpo_fp32=False, **PAIRS)
    ok(train_impl="dpo", dpo_reference_free=True, **PAIRS)
    ok(train_impl="rm", z_loss=0.01, pack_impl="unpacked", dataset_impl="pairwise", **PAIRS)
    ok(train_impl="kto", kto_beta=0.3, kto_desirable_weight=1.3, **KTO)
    ok(train_impl="normal", z_loss=1e-4, eod_mask_loss=True, use_dummy_dataset=False, train_data_paths=["t"],
       train_label_data_paths=["l"])
    ok(train_impl="dpo")  # dummy preference pairs (benchmarks)


def test_keys_of_another_objective_are_refused() -> None:
    message = problems(dpo_beta=0.2, kto_beta=0.3)
    assert "dpo_beta=0.2 (cfg.yml:9) only apply to train_impl: dpo" in message
    assert "kto_beta=0.3 (cfg.yml:10) only apply to train_impl: kto" in message
    assert "z_loss=0.1 (cfg.yml:10) applies to language modelling and reward models" in problems(
        train_impl="dpo", z_loss=0.1, **PAIRS)
    assert "reference_logps='r' (cfg.yml:9) is read by train_impl dpo only" in problems(reference_logps="r")
    assert "mismatched prompt/completion pairs" in problems(train_impl="kto", reference_logps="r", **KTO)
    assert "contradict each other" in problems(train_impl="dpo", dpo_reference_free=True, reference_logps="r", **PAIRS)
    assert "eod_mask_loss=True" in problems(train_impl="rm", eod_mask_loss=True, **PAIRS)


def test_objectives_name_the_data_they_need() -> None:
    assert "pos_train_data_paths and neg_train_data_paths" in problems(
        train_impl="dpo", use_dummy_dataset=False, train_data_paths=["t"])
    assert "train_data_paths=['t'] (cfg.yml:10) is not read by train_impl='dpo'" in problems(
        train_impl="dpo", train_data_paths=["t"], **PAIRS)
    assert "hold preference pairs, read by train_impl dpo or rm only" in problems(**PAIRS)
    assert "train_reward_data_paths" in problems(train_impl="kto", use_dummy_dataset=False, train_data_paths=["t"])
    assert "are per-document rewards for train_impl: kto" in problems(
        use_dummy_dataset=False, train_data_paths=["t"], train_reward_data_paths=["r"])
    assert "never packed" in problems(train_impl="dpo", pack_impl="packed", **PAIRS)
    assert "dataset_impl='gpt2'" in problems(train_impl="rm", dataset_impl="gpt2", **PAIRS)


def test_kto_needs_two_samples_per_micro_batch() -> None:
    message = problems(train_impl="kto", train_micro_batch_size_per_gpu=1, **KTO)
    assert "train_micro_batch_size_per_gpu=1 (cfg.yml:5) with train_impl: kto" in message and "at least 2" in message
    derived = problems(train_impl="kto", train_micro_batch_size_per_gpu=None, train_batch_size=1, **KTO)
    assert "train_micro_batch_size_per_gpu=1 (derived) with train_impl: kto" in derived  # from train_batch_size


def _checkpoint(directory: Path, step: int, args: dict[str, Any]) -> Path:
    """A committed checkpoint directory with only what ``starting_point`` reads (its metadata)."""
    import json

    tag_dir = directory / commit.tag_for(step)
    tag_dir.mkdir(parents=True)
    (tag_dir / "deepy_meta.json").write_text(json.dumps({"format": 1, "iteration": step, "args": args}))
    commit.write_commit_marker(tag_dir, commit.CommitInfo(step, "step", 0.0))
    commit.write_latest(directory, tag_dir.name)
    return tag_dir


def test_reference_starting_point_survives_resumes(tmp_path: Path) -> None:
    sft = _checkpoint(tmp_path / "sft", 10, {"train_impl": "normal"})
    assert starting_point(CheckpointArgs(), "dpo") == StartingPoint(None)  # the seeded init
    assert starting_point(CheckpointArgs(initialize_from=str(tmp_path / "sft")), "dpo").checkpoint == sft
    assert starting_point(CheckpointArgs(load=str(tmp_path / "sft"), finetune=True), "dpo").checkpoint == sft
    # a DPO run's own checkpoint: its reference is where *that* run started
    _checkpoint(tmp_path / "dpo", 3, {"train_impl": "dpo", "initialize_from": str(tmp_path / "sft")})
    assert starting_point(CheckpointArgs(load=str(tmp_path / "dpo")), "dpo").checkpoint == sft
    _checkpoint(tmp_path / "dpo_scratch", 3, {"train_impl": "dpo", "load": str(tmp_path / "dpo_scratch")})
    assert starting_point(CheckpointArgs(load=str(tmp_path / "dpo_scratch")), "dpo").checkpoint is None
    # loading another objective's checkpoint as if resuming would lose the reference at the next resume
    with pytest.raises(ConfigError, match="initialize_from"):
        starting_point(CheckpointArgs(load=str(tmp_path / "sft")), "dpo")
    with pytest.raises(ConfigError, match="no committed checkpoint"):
        starting_point(CheckpointArgs(initialize_from=str(tmp_path / "empty")), "dpo")


def test_dpo_reference_logps_must_have_been_precomputed(tmp_path: Path) -> None:
    """``reference_logps: ref`` names ``<prefix>_ref`` beside every chosen/rejected dataset: missing ones
    are named before launch with the precompute command; present ones pass."""
    message = problems(train_impl="dpo", reference_logps="ref", **PAIRS)
    assert "reference log-probs of pos_train_data_paths p: p_ref.bin and p_ref.idx not found" in message
    assert "text_gen_type=precompute precompute_model_name=ref" in message
    make_dataset(tmp_path / "p_ref")
    make_dataset(tmp_path / "n_ref")
    from megatron.data.reference_logprobs import write_record

    for name in ("p_ref", "n_ref"):  # scored at the run's seq_length (megatron/data/reference_logprobs.py)
        write_record(str(tmp_path / name), 128)
    ok(train_impl="dpo", reference_logps="ref", **PAIRS)
