"""MoE configs: the moe_* rules before launch, GPT-NeoX's 125M-dmoe.yml loading unchanged, the
shipped MoE configs resolving, and the keys reaching the model config."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from megatron.errors import ConfigError
from megatron.model import GPTConfig
from megatron.neox_arguments.arguments import NeoXArgs
from megatron.neox_arguments.derived import finalize
from megatron.neox_arguments.loading import load_config
from megatron.neox_arguments.resolved import ResolvedConfig
from megatron.config_rules import Device

REPO = Path(__file__).resolve().parents[2]
CPU = Device(cuda=False, fp16_supported=False)
BASE: dict[str, Any] = {
    "num_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 128,
    "train_micro_batch_size_per_gpu": 4, "train_iters": 100, "lr": 1e-3, "use_dummy_dataset": True,
    "moe_num_experts": 4,
}  # fmt: skip


def finalized(world: int, **values: Any) -> ResolvedConfig:
    merged = {**BASE, **values}
    merged.setdefault("tokenizer_type", "CharLevelTokenizer")  # dummy data still needs a tokenizer
    provenance = {key: f"cfg.yml:{line}" for line, key in enumerate(merged, start=1)}
    return finalize(ResolvedConfig(args=NeoXArgs(**merged), provenance=provenance), world, device=CPU)


def problems(world: int = 1, **values: Any) -> str:
    with pytest.raises(ConfigError) as err:
        finalized(world, **values)
    return err.value.message


def test_a_good_moe_config_passes_every_rule() -> None:
    args = finalized(4, model_parallel_size=2, moe_expert_parallel_size=2, moe_top_k=2,
                     zero_optimization={"stage": 0}).args  # fmt: skip
    assert (args.moe_num_experts, args.moe_expert_parallel_size) == (4, 2)
    finalized(2, model_parallel_size=2, zero_optimization={"stage": 2}, precision="bfloat16")  # tp only: any ZeRO


@pytest.mark.parametrize(
    "world,values,needles",
    [
        (2, dict(moe_num_experts=3, model_parallel_size=2),
         ["moe_num_experts=3 (cfg.yml:9)", "x moe_expert_parallel_size"]),
        (4, dict(moe_expert_parallel_size=4, model_parallel_size=2), ["is not divisible by model_parallel_size"]),
        (3, dict(moe_num_experts=6, moe_expert_parallel_size=2), ["does not divide the data-parallel size 3"]),
        (1, dict(moe_top_k=5), ["moe_top_k=5", "exceeds moe_num_experts=4"]),
        (2, dict(moe_expert_parallel_size=2, zero_optimization={"stage": 1}),
         ["with ZeRO stage 1", "not supported yet"]),
        (2, dict(moe_expert_parallel_size=2, precision="bfloat16"), ["precision=bfloat16", "fp32 only"]),
        (1, dict(moe_num_experts=1, moe_top_k=2, moe_aux_loss_coeff=0.1), ["moe_top_k=2", "moe_aux_loss_coeff=0.1",
                                                                            "a model with one expert has none"]),
    ],
)
def test_moe_rules_name_the_keys(world: int, values: dict[str, Any], needles: list[str]) -> None:
    message = problems(world, **values)
    for needle in needles:
        assert needle in message, message


def test_keys_at_their_defaults_are_fine_on_a_dense_model() -> None:
    finalized(1, moe_num_experts=1, moe_router_type="sinkhorn", moe_top_k=1)


def test_moe_keys_reach_the_model_config() -> None:
    args = finalized(1, moe_top_k=2, moe_router_type="topk", moe_expert_interval=2, moe_jitter_eps=0.01,
                     moe_lbl_in_fp32=True, moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001).args  # fmt: skip
    cfg: GPTConfig = args  # the arguments are the model config
    assert (cfg.moe_num_experts, cfg.moe_top_k, cfg.moe_router_type, cfg.moe_expert_interval) == (4, 2, "topk", 2)
    assert (cfg.moe_jitter_eps, cfg.moe_lbl_in_fp32, cfg.moe_aux_loss_coeff, cfg.moe_z_loss_coeff) == (
        0.01, True, 0.01, 0.001)  # fmt: skip
    assert [cfg.is_moe_layer(i) for i in range(4)] == [True, False, True, False]


# GPT-NeoX's configs/125M-dmoe.yml, key for key (its values; comments dropped), written in its own
# JSON-with-comments style with trailing commas and Python-style True
GPT_NEOX_125M_DMOE = """\
{
   "pipe_parallel_size": 2,
   "model_parallel_size": 2,
   "num_layers": 12,
   "hidden_size": 1024,
   "num_attention_heads": 16,
   "seq_length": 2048,
   "max_position_embeddings": 2048,
   "norm": "layernorm",
   "pos_emb": "rotary",
   "no_weight_tying": true,
   "moe_num_experts": 8,
   "scaled_upper_triang_masked_softmax_fusion": false,
   "bias_gelu_fusion": false,
   "rope_fusion": false,
   "layernorm_fusion": false,
   "optimizer": {"type": "Adam", "params": {"lr": 0.0006, "betas": [0.9, 0.999], "eps": 1.0e-8,}},
   "zero_optimization": {
    "stage": 0,
    "allgather_partitions": True,
    "allgather_bucket_size": 500000000,
    "overlap_comm": True,
    "reduce_scatter": True,
    "reduce_bucket_size": 500000000,
    "contiguous_gradients": True,
  },
   "train_micro_batch_size_per_gpu": 4,
   "data_impl": "mmap",
   "split": "949,50,1",
   "checkpoint_activations": true,
   "checkpoint_num_layers": 1,
   "partition_activations": true,
   "synchronize_each_layer": true,
   "gradient_clipping": 1.0,
   "weight_decay": 0.0,
   "hidden_dropout": 0.0,
   "attention_dropout": 0.0,
   "precision": "bfloat16",
   "fp32_allreduce": True,
   "train_iters": 5,
   "lr_decay_iters": 320000,
   "distributed_backend": "nccl",
   "min_lr": 0.0006,
   "warmup": 0.0,
   "checkpoint_factor": 10000,
   "eval_interval": 1000,
   "eval_iters": 10,
   "log_interval": 1,
   "steps_per_print": 1,
   "keep_last_n_checkpoints": 4,
   "wall_clock_breakdown": true,
}
"""


def test_gpt_neox_125m_dmoe_loads_unchanged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "125M-dmoe.yml").write_text(GPT_NEOX_125M_DMOE)
    # what a local setup file adds (data, tokenizer, where to save); the model file stays as published
    (tmp_path / "data.yml").write_text("use_dummy_dataset: true\ntokenizer_type: CharLevelTokenizer\nsave: ckpt\n")
    monkeypatch.chdir(tmp_path)
    final = finalize(load_config(["125M-dmoe.yml", "data.yml"]), 4, device=CPU)  # pp2 x tp2
    cfg: GPTConfig = final.args
    assert cfg.moe_num_experts == 8 and cfg.num_moe_layers == 12  # every block, as GPT-NeoX
    assert (cfg.moe_router_type, cfg.moe_top_k) == ("sinkhorn", 1)  # GPT-NeoX's defaults
    cfg.for_tokenizer(50304).check_tensor_parallel(2)  # 8 experts split over the 2 tensor-parallel ranks


@pytest.mark.parametrize("config", ["configs/125M-dmoe.yml", "configs/tiny-moe.yml"])
def test_shipped_moe_configs_resolve(config: str, local_setup_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron.neox_arguments import detect_world_size

    monkeypatch.chdir(local_setup_dir)  # data/ and configs/ as local_setup.yml names them
    resolved = load_config([config, "configs/local_setup.yml"])
    final = finalize(resolved, detect_world_size(resolved.args), device=CPU)
    assert final.args.moe_num_experts > 1
