"""Shared blocks, soft prompts and muP through the layout-change path and the Hugging Face export (issue 47).

* A pipeline checkpoint of a model with shared blocks and a soft prompt resumes as the plain model and back (the
  layout-change path, ZeRO-0: ``reshard.zero0_to_universal``, ``write_frozen_parameters``, the names
  ``complete_for_any_target`` links): every weight arrives equal to the one saved.
* Shared blocks export to transformers as an unshared model holding a copy per position, whose logits are our
  shared model's; a soft prompt or muP has no transformers equivalent and is refused by key.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from test_hf_conversion import NEOX, hf_logits, our_logits
from test_model_options import _batch, _engine

from megatron.errors import ConversionError
from megatron.interop.hf_config import SpecialTokens, choose_architecture, hf_config_from_gpt
from megatron.interop.hf_model import fixed_batch, save_hf_model
from megatron.interop.hf_weights import to_hf_state_dict
from megatron.model import GPTConfig, GPTModel
from megatron.model.pipeline import model_parameter_name

PROMPTED_SHARED = dict(num_unique_layers=2, soft_prompt_tuning={"enabled": True, "n_tokens": 2})


def _manager(eng: Any, **paths: str) -> Any:
    from megatron.checkpointing.config import CheckpointArgs
    from megatron.checkpointing.manager import CheckpointManager
    from megatron.checkpointing.preemption import PreemptionWatcher
    from megatron.checkpointing.universal import universal_checkpoint_info

    manager = CheckpointManager.from_config(CheckpointArgs(checkpoint_factor=1, **paths),
                                            args_record=json.loads(eng.config.model_dump_json()), train_iters=10,
                                            preemption=PreemptionWatcher())
    manager.universal_info = universal_checkpoint_info(eng.config, 1)
    return manager


def test_shared_blocks_and_the_prompt_resume_between_pipeline_and_plain_layouts(tmp_path: Path) -> None:
    from single_rank import init_single_rank_gloo

    from megatron import mpu
    from megatron.objectives.base import MicroBatch

    init_single_rank_gloo()
    mpu.initialize_model_parallel(1, 1)
    try:
        pipe = _engine(pipe_parallel_size=1, **PROMPTED_SHARED)  # grouped: positions 0, 2 and 1, 3
        tokens, labels = _batch()
        batch = MicroBatch(tokens, labels, units=float(labels.numel()))
        pipe.engine.train_batch(iter([(batch.pipe_inputs(), batch.targets(float(labels.numel())))]))
        saved = {n: p.detach().clone() for n, p in pipe.engine.module.named_parameters()}
        assert any(n.startswith("tied_modules.shared_block_1.") for n in saved)
        _manager(pipe, save=str(tmp_path / "a")).save(pipe.engine, step=1, consumed_samples=2)
    finally:
        mpu.destroy_model_parallel()

    mpu.initialize_model_parallel(1, 0)
    try:
        plain = _engine(seed=9, **PROMPTED_SHARED)
        result = _manager(plain, load=str(tmp_path / "a"), save=str(tmp_path / "b")).load(plain.engine)
        assert result.loaded and any("layout changed" in note for note in result.notes), result.notes
        loaded = dict(plain.engine.module.named_parameters())
        assert set(loaded) == {model_parameter_name(n) for n in saved}
        for name, tensor in saved.items():
            assert torch.equal(loaded[model_parameter_name(name)].detach(), tensor), name
        assert plain.engine.module.layers[0] is plain.engine.module.layers[2]
        _manager(plain, save=str(tmp_path / "b")).save(plain.engine, step=2, consumed_samples=4)
    finally:
        mpu.destroy_model_parallel()

    mpu.initialize_model_parallel(1, 1)
    try:
        back = _engine(pipe_parallel_size=1, seed=10, **PROMPTED_SHARED)
        assert _manager(back, load=str(tmp_path / "b")).load(back.engine).loaded
        for name, param in back.engine.module.named_parameters():
            assert torch.equal(param.detach(), saved[name]), name
    finally:
        mpu.destroy_model_parallel()


def test_shared_blocks_export_as_copies_with_our_logits(tmp_path: Path) -> None:
    """transformers' model (4 independent layers, the shared sets' weights copied) gives our shared model's logits;
    the same weights in the unshared order would not."""
    config = GPTConfig(**dict(NEOX, num_layers=4), num_unique_layers=2)  # grouped: sets [0, 1, 0, 1]
    model = GPTModel(config)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=gen))
    weights = {k: v.clone() for k, v in model.state_dict().items()}  # every position, as checkpoints hold them
    arch = choose_architecture(config)
    save_hf_model(hf_config_from_gpt(config, SpecialTokens(0, 0, 1), torch.float32),
                  to_hf_state_dict(config, arch, weights), tmp_path, torch.float32)
    assert json.loads((tmp_path / "config.json").read_text())["num_hidden_layers"] == 4
    tokens = fixed_batch(config.padded_vocab_size, 40)
    theirs = hf_logits(tmp_path, tokens)
    assert (our_logits(config, weights, tokens) - theirs).abs().max().item() <= 1e-4
    spread = config.replace(param_sharing_style="spread")  # sets [0, 0, 1, 1]: another model on these weights
    assert (our_logits(spread, weights, tokens) - theirs).abs().max().item() > 1e-3


@pytest.mark.parametrize("changes, named", [
    (dict(soft_prompt_tuning={"enabled": True, "n_tokens": 3}), "soft_prompt_tuning: enabled"),
    (dict(use_mup=True), "use_mup: true"),
])
def test_a_soft_prompt_or_mup_export_is_refused_by_key(changes: dict, named: str) -> None:
    with pytest.raises(ConversionError, match="no faithful Hugging Face") as err:
        choose_architecture(GPTConfig(**NEOX, **changes))
    assert named in str(err.value)
    choose_architecture(GPTConfig(**NEOX, soft_prompt_tuning={"enabled": False}))  # a disabled prompt exports
