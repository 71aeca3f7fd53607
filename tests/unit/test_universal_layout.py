"""Layout-change decisions and the universal-checkpoint metadata, without launching ranks."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from megatron.checkpointing import reshard, universal
from megatron.checkpointing.universal import Layout, check_convertible, needs_universal
from megatron.errors import CheckpointError
from megatron.model.config import GPTConfig


def test_which_changes_need_a_conversion() -> None:
    base = Layout(tp=1, pp=1, dp=2, zero_stage=1, pipeline=True)
    assert not needs_universal(base, base)
    assert needs_universal(base, Layout(1, 1, 1, 1, True))  # ZeRO shards are per dp rank
    assert needs_universal(base, Layout(1, 1, 2, 2, True))
    assert needs_universal(base, Layout(2, 1, 1, 1, True))
    # without ZeRO every dp rank holds the whole optimizer: DeepSpeed reads it directly
    assert not needs_universal(Layout(1, 1, 2, 0), Layout(1, 1, 4, 0))


def test_dense_changes_are_accepted_and_moe_ones_refused_with_the_reason() -> None:
    # ZeRO-0 and ZeRO-3 sides and pipeline <-> plain go through Deepy's resharding (reshard.py)
    check_convertible(Layout(2, 1, 1, 0), Layout(1, 1, 2, 0))
    check_convertible(Layout(1, 2, 1, 1, pipeline=True), Layout(1, 1, 2, 3, pipeline=False))
    check_convertible(Layout(2, 2, 1, 1, True), Layout(1, 1, 4, 2, True))
    check_convertible(Layout(2, 1, 1, 1), Layout(1, 1, 2, 2), moe=True)
    check_convertible(Layout(1, 1, 2, 3), Layout(2, 1, 1, 0))
    for saved, loading in ((Layout(2, 1, 1, 3), Layout(1, 1, 2, 3)), (Layout(1, 1, 2, 1), Layout(2, 1, 1, 3))):
        with pytest.raises(CheckpointError, match="ZeRO stage 3 with tensor parallelism"):
            check_convertible(saved, loading)
    with pytest.raises(CheckpointError, match="mixture-of-experts"):
        check_convertible(Layout(2, 1, 1, 0), Layout(1, 1, 2, 0), moe=True)
    with pytest.raises(CheckpointError, match="mixture-of-experts"):
        check_convertible(Layout(1, 1, 2, 1, pipeline=True), Layout(1, 1, 2, 1), moe=True)
    assert Layout.from_dict(Layout(2, 1, 3, 1, True).to_dict()) == Layout(2, 1, 3, 1, True)
    assert Layout.from_dict({"tp": 1, "pp": 1, "dp": 1, "zero_stage": 1}).pipeline is False


def _classify(info: dict, name: str) -> str:
    def hit(patterns: list[str]) -> bool:
        return any(re.match(p, name) for p in patterns)

    kinds = []
    if hit(info["tp_replicated_parameter_patterns"]):
        kinds.append("replicated")
    if hit(info["parameter_with_row_parallelism_patterns"]):
        kinds.append("row")
    if hit(info["vocabulary_parameter_patterns"]):
        kinds.append("vocab")
    if any(hit(sub["patterns"]) for sub in info["parameter_with_sub_params"]):
        kinds.append("sections")
    assert len(kinds) <= 1, (name, kinds)
    return kinds[0] if kinds else "column"


@pytest.mark.parametrize("prefix", ["layers.0.", "3."])  # plain model and PipelineModule names
def test_universal_info_classifies_every_parameter(prefix: str) -> None:
    config = GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_kv_heads=2, seq_length=128,
                       activation="swiglu", intermediate_size=768, padded_vocab_size=256)
    info = universal.universal_checkpoint_info(config, tp=2)
    expected = {
        "attention.query_key_value.weight": "sections",
        "attention.query_key_value.bias": "sections",
        "attention.dense.weight": "row",
        "attention.dense.bias": "replicated",
        "mlp.dense_h_to_4h.weight": "sections",
        "mlp.dense_4h_to_h.weight": "row",
        "mlp.dense_4h_to_h.bias": "replicated",
        "input_layernorm.weight": "replicated",
    }
    for name, kind in expected.items():
        assert _classify(info, prefix + name) == kind, name
    assert _classify(info, "embedding.word_embeddings.weight") == "vocab"
    assert _classify(info, "final_norm.weight") == "replicated"
    # fused QKV: 4 query heads and 2+2 kv heads of 16, each section split over 2 ranks
    qkv = next(s for s in info["parameter_with_sub_params"] if re.match(s["patterns"][0], "x.attention.query_key_value.weight"))
    assert qkv["shape"] == ((64, 32, 32), -1)
    assert info["sub_param_shard_widths"][qkv["patterns"][0]] == [[32, 32], [16, 16], [16, 16]]
    assert info["original_vocab_size"] == 256


def test_padded_vocabulary_is_trimmed_for_a_smaller_tp(tmp_path: Path) -> None:
    info = {"vocabulary_parameter_patterns": [r".*(?:word_embeddings\.weight$)"]}
    for name, rows in (("embedding.word_embeddings.weight", 512), ("final_norm.weight", 512)):
        folder = tmp_path / "zero" / name
        folder.mkdir(parents=True)
        for state in ("fp32", "exp_avg"):
            torch.save({"param": torch.arange(rows * 2.0).view(rows, 2)}, folder / f"{state}.pt")
        torch.save(torch.tensor(3), folder / "step.pt")
    trimmed = reshard.fit_vocabulary_rows(tmp_path / "zero", info["vocabulary_parameter_patterns"], rows=384)
    assert sorted(trimmed) == ["embedding.word_embeddings.weight/exp_avg.pt", "embedding.word_embeddings.weight/fp32.pt"]
    kept = torch.load(tmp_path / "zero" / "embedding.word_embeddings.weight" / "fp32.pt", weights_only=True)["param"]
    assert kept.shape == (384, 2) and kept[383, 1].item() == 767.0
    other = torch.load(tmp_path / "zero" / "final_norm.weight" / "fp32.pt", weights_only=True)["param"]
    assert other.shape == (512, 2)  # not a vocabulary tensor
    assert reshard.fit_vocabulary_rows(tmp_path / "zero", info["vocabulary_parameter_patterns"], rows=384) == []
    # a larger tp pads more: zero rows are added (DeepSpeed's loader cannot cut rows it lacks for a ZeRO-0 target)
    assert reshard.fit_vocabulary_rows(tmp_path / "zero", info["vocabulary_parameter_patterns"], rows=400)
    grown = torch.load(tmp_path / "zero" / "embedding.word_embeddings.weight" / "fp32.pt", weights_only=True)["param"]
    assert grown.shape == (400, 2) and grown[383, 1].item() == 767.0 and not grown[384:].any()


def test_a_conversion_is_written_where_the_loading_run_writes(tmp_path: Path) -> None:
    """Issue 30 item 10: never into the source directory (it may be read-only, or another run's)."""
    import tempfile
    import time

    from megatron.checkpointing import commit
    from megatron.checkpointing.universal import conversion_dir, foreign_conversions

    source = tmp_path / "a" / "global_step4"
    source.mkdir(parents=True)
    commit.write_commit_marker(source, commit.CommitInfo(step=4, kind="step", time=1.0))
    save = tmp_path / "b"
    assert conversion_dir(source, tmp_path / "a") == tmp_path / "a" / "global_step4_universal"  # its own run's
    beside = conversion_dir(source, save)
    assert beside.parent == save and beside.name.startswith("global_step4_universal_of_")
    beside.mkdir(parents=True)
    assert foreign_conversions(save) == [beside]
    assert conversion_dir(source, None).parent == Path(tempfile.gettempdir()) / "deepy_universal"
    # the same tag written again (a rewound run replaced it) is another source: the cached conversion is not reused
    commit.write_commit_marker(source, commit.CommitInfo(step=4, kind="step", time=time.time()))
    assert conversion_dir(source, save) != beside
