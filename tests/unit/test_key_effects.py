"""Small keys whose effect one call shows: each test sets the key and observes what changes, against a
direct computation where there is one."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from megatron.model import GPTConfig, GPTModel
from megatron.neox_arguments.run_config import RunConfig

BASE: dict[str, Any] = {
    "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 16, "max_position_embeddings": 16,
    "train_micro_batch_size_per_gpu": 2, "train_iters": 4, "lr": 1e-3, "use_dummy_dataset": True,
    "tokenizer_type": "CharLevelTokenizer",
}  # fmt: skip


def test_make_vocab_size_divisible_by_pads_the_embedding_rows() -> None:
    for divisor, want in ((64, 320), (100, 300), (1, 257)):
        run = RunConfig.from_mapping({**BASE, "make_vocab_size_divisible_by": divisor})
        assert run.tokenizer.padded(257, run.parallel.model_parallel_size) == want  # 257 = the byte tokenizer's vocabulary


def test_per_device_parallelism_is_the_micro_batch() -> None:
    values = {k: v for k, v in BASE.items() if k != "train_micro_batch_size_per_gpu"}
    run = RunConfig.from_mapping({**values, "per_device_parallelism": 3})
    assert (run.training.batch.micro, run.data.train_batch_size) == (3, 3)


def test_rotary_save_freqs_buffer_puts_the_frequencies_in_the_state_dict() -> None:
    names = {flag: [k for k in GPTModel(GPTConfig(num_layers=1, hidden_size=32, num_attention_heads=4, seq_length=8,
                                                  padded_vocab_size=64, pos_emb="rotary",
                                                  rotary_save_freqs_buffer=flag)).state_dict() if "freq" in k]
             for flag in (False, True)}
    assert names[False] == [] and names[True]


@pytest.mark.parametrize(("method", "std"), [("wang_init", 2.0 / 2 / math.sqrt(64)),
                                             ("small_init", math.sqrt(2.0 / (5 * 64)))])
def test_output_layer_init_method_sets_the_output_projections_std(method: str, std: float) -> None:
    """GPT-NeoX's formulas (its documented init methods), for the projections that write the residual."""
    args = RunConfig.from_mapping({**BASE, "output_layer_init_method": method}).model.with_vocab(64)
    weights = GPTModel(args).state_dict()
    projections = torch.cat([weights[k].flatten() for k in weights
                             if k.endswith(("attention.dense.weight", "dense_4h_to_h.weight"))])
    assert projections.numel() > 10_000 and projections.std().item() == pytest.approx(std, rel=0.05)


def test_dpo_reference_free_compares_against_a_zero_reference() -> None:
    """Reference-free DPO: no reference is built, the loss is -log sigmoid(beta (log pi_c - log pi_r))."""
    from megatron.neox_arguments.arguments import NeoXArgs
    from megatron.objectives import build_objective
    from megatron.objectives.reference import NoReference, build_reference

    config = NeoXArgs(train_impl="dpo", dpo_reference_free=True, dpo_beta=0.5)
    objective = build_objective(config, eod_token=None)
    assert isinstance(build_reference(objective, None, False, None, {}, None), NoReference)
    tokens = torch.randint(0, 8, (2, 5))
    batch = objective.prepare({"chosen": tokens[:1], "chosen_label": tokens[:1], "rejected": tokens[1:],
                               "rejected_label": tokens[1:]})
    output = torch.randn(2, 4, 8)
    labels, *extras, reference, _ = batch.targets(1.0)
    loss, _ = objective.loss_sum(output, labels, tuple(extras), reference)
    logp = torch.log_softmax(output, -1).gather(-1, batch.labels[..., None])[..., 0].sum(1)
    assert loss.item() == pytest.approx(-torch.nn.functional.logsigmoid(0.5 * (logp[0] - logp[1])).item(), rel=1e-5)


@pytest.mark.parametrize("fp32", [True, False])
def test_kto_fp32_sums_the_log_probs_in_fp32(fp32: bool) -> None:
    from megatron.neox_arguments.arguments import NeoXArgs
    from megatron.objectives import build_objective

    objective = build_objective(NeoXArgs(train_impl="kto", kto_fp32=fp32), eod_token=None)
    output = torch.randn(2, 6, 8).to(torch.bfloat16)
    labels = torch.randint(0, 8, (2, 6))
    assert objective.reference_logps(output, labels).dtype == (torch.float32 if fp32 else torch.bfloat16)
