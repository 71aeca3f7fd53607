"""GPT-NeoX's DeepSpeed blocks (issue 47; docs/deepspeed_blocks.md): the sequence curriculum (curriculum_learning, and
data_efficiency's seqlen_truncate metric) against DeepSpeed 0.19.8's own CurriculumScheduler and GPT-NeoX's cut
(ea7aefd8 megatron/training.py get_batch_pipe), on a real one-rank engine through the training loop; and the blocks
refused by name (autotuning, data_efficiency's other parts, extra-args spellings)."""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from megatron.config_rules import Device
from megatron.errors import ConfigError
from megatron.neox_arguments import NeoXArgs, config_from_mapping
from megatron.neox_arguments.derived import finalize
from megatron.training.curriculum import CurriculumArgs, build_curriculum

SEQ = 16
LINEAR = {"enabled": True, "curriculum_type": "seqlen", "min_difficulty": 4, "max_difficulty": SEQ,
          "schedule_type": "fixed_linear", "schedule_config": {"total_curriculum_step": 6, "difficulty_step": 4}}
ROOT = {**LINEAR, "schedule_type": "fixed_root",
        "schedule_config": {"total_curriculum_step": 9, "difficulty_step": 2, "root_degree": 2}}
DISCRETE = {**LINEAR, "schedule_type": "fixed_discrete", "schedule_config": {"difficulty": [4, 8, 16], "max_step": [2, 4]}}
BASE = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=SEQ, train_iters=10, lr=1e-3,
            train_micro_batch_size_per_gpu=2, use_dummy_dataset=True, tokenizer_type="CharLevelTokenizer")
DEVICE = Device(cuda=False, fp16_supported=False)


def _deepspeed_lengths(block: dict[str, Any], steps: range, resume_at: int = 0) -> list[int]:
    """DeepSpeed's scheduler as GPT-NeoX drives it: built from the block, brought to a resumed iteration, then asked
    ``update_difficulty(iteration + 1)`` before each step."""
    from deepspeed.runtime.data_pipeline.curriculum_scheduler import CurriculumScheduler

    scheduler = CurriculumScheduler(copy.deepcopy(block))
    if resume_at:
        scheduler.update_difficulty(resume_at)
    return [scheduler.update_difficulty(step) for step in steps]


def _lengths(keys: dict[str, Any], steps: range, resume_at: int = 0) -> list[int]:
    curriculum = build_curriculum(CurriculumArgs(**keys), SEQ, completed_steps=resume_at)
    assert curriculum is not None
    return [curriculum.length_at(step) for step in steps]


@pytest.mark.parametrize("block", [LINEAR, ROOT, DISCRETE], ids=["fixed_linear", "fixed_root", "fixed_discrete"])
def test_curriculum_lengths_are_deepspeeds_scheduler(block: dict[str, Any]) -> None:
    steps = range(1, 13)
    assert _lengths({"curriculum_learning": block}, steps) == _deepspeed_lengths(block, steps)
    # a run resumed after 5 steps goes on as the uninterrupted one (GPT-NeoX: update_difficulty(iteration) first)
    assert _lengths({"curriculum_learning": block}, range(6, 13), resume_at=5) == _deepspeed_lengths(block, steps)[5:]
    # the same schedule spelled as DeepSpeed's data_efficiency block (Megatron-DeepSpeed's seqlen_truncate metric)
    metric = {k: v for k, v in block.items() if k not in ("enabled", "curriculum_type")}
    data_efficiency = {"enabled": True, "data_sampling": {"enabled": True, "curriculum_learning": {
        "enabled": True, "curriculum_metrics": {"seqlen_truncate": {"difficulty_type": "value",
                                                                     "clustering_type": "single_cluster", **metric}}}}}
    assert _lengths({"data_efficiency": data_efficiency}, steps) == _deepspeed_lengths(block, steps)


def test_fixed_linear_is_deepspeeds_formula() -> None:
    """Re-derived from DeepSpeed 0.19.8's __fixed_root_get_difficulty with degree 1: floor(n / T * (max - min) + min),
    floored to a multiple of difficulty_step (not below min's next multiple), capped at max."""
    def expected(n: int) -> int:
        value = math.floor(n / 6 * (SEQ - 4) + 4)
        value -= value % 4
        return min(max(value, 4), SEQ)

    assert _lengths({"curriculum_learning": LINEAR}, range(1, 9)) == [expected(n) for n in range(1, 9)]
    assert _lengths({"curriculum_learning": LINEAR}, range(1, 9)) == [4, 8, 8, 12, 12, 16, 16, 16]


def test_off_without_an_enabled_block() -> None:
    assert build_curriculum(CurriculumArgs(), SEQ, 0) is None
    assert build_curriculum(CurriculumArgs(curriculum_learning={**LINEAR, "enabled": False}), SEQ, 0) is None
    assert build_curriculum(CurriculumArgs(data_efficiency={"enabled": False}), SEQ, 0) is None


class _Monitor:
    """The loop's monitor: every step is a log step, rows kept."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def before_step(self, it: int) -> None: ...
    def after_step(self, it: int) -> None: ...
    def is_log_step(self, it: int) -> bool:
        return True
    def log(self, row: dict[str, Any], it: int) -> None:
        self.rows.append(row)
    def window_metrics(self, steps: int) -> dict[str, float]:
        return {}
    def discard_window(self) -> None: ...


def test_a_short_run_trains_each_step_on_the_scheduled_length() -> None:
    """Through the loop and a real one-rank DeepSpeed engine: the model sees ``[b, L_n]`` at step n, L_n DeepSpeed's
    scheduler's; the logged train/curriculum_seqlen is L_n and the step's loss is the cross-entropy of the first L_n
    tokens computed directly (GPT-NeoX cuts tokens and labels the same way), consumed tokens count L_n per sample."""
    import deepspeed

    from single_rank import init_single_rank_gloo

    from megatron import mpu
    from megatron.engine.build import Engine
    from megatron.model import GPTConfig, GPTModel
    from megatron.training import loop
    from megatron.training.loop import LoopContext, TrainState

    init_single_rank_gloo()
    mpu.initialize_model_parallel(1, 0)
    try:
        config = GPTConfig(num_layers=1, hidden_size=16, num_attention_heads=2, seq_length=SEQ, padded_vocab_size=32,
                           seed=3, no_weight_tying=True, precision="fp32")
        torch.manual_seed(0)
        model = GPTModel(config)
        before = copy.deepcopy(model)
        seen: list[int] = []
        model.register_forward_pre_hook(lambda module, inputs: seen.append(int(inputs[0].shape[1])))
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
                                          config={"train_batch_size": 2, "train_micro_batch_size_per_gpu": 2,
                                                  "steps_per_print": 10**9})
        eng = Engine(engine=engine, optimizer=engine.optimizer, lr_scheduler=torch.optim.lr_scheduler.LambdaLR(  # type: ignore[arg-type]
            engine.optimizer, lambda _: 1.0), config=config, is_pipe=False, ds_config={})
        generator = torch.Generator().manual_seed(1)
        samples = [{"text": torch.randint(0, 32, (2, SEQ + 1), generator=generator)} for _ in range(5)]
        curriculum = build_curriculum(CurriculumArgs(curriculum_learning=LINEAR), SEQ, completed_steps=0)
        monitor = _Monitor()
        ctx = LoopContext(eng=eng, training=NeoXArgs(exit_interval=None),  # type: ignore[arg-type]
                          micro_batches=iter(samples), device=torch.device("cpu"), train_iters=5, global_batch_size=2,
                          tokens_per_step=2 * SEQ, flops_per_token=1.0, world_size=1, peak_tflops=None,
                          monitor=monitor, curriculum=curriculum)  # type: ignore[arg-type]
        state = loop.train(ctx, TrainState(), loop.Hooks())
    finally:
        mpu.destroy_model_parallel()
    lengths = _deepspeed_lengths(LINEAR, range(1, 6))
    assert lengths == [4, 8, 8, 12, 12]  # the run's steps cover several lengths
    assert seen == lengths
    assert [row["train/curriculum_seqlen"] for row in monitor.rows] == lengths
    assert state.consumed_tokens == sum(2 * n for n in lengths)
    with torch.no_grad():  # lr 0: the weights stay those of step 1
        for row, sample, n in zip(monitor.rows, samples, lengths):
            text = sample["text"]
            logits = before(text[:, :n])
            direct = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), text[:, 1:n + 1].reshape(-1))
            assert row["train/lm_loss"] == pytest.approx(float(direct), rel=1e-5)


def _refused(**keys: Any) -> str:
    with pytest.raises(ConfigError) as info:
        finalize(config_from_mapping({**BASE, **keys}), 1, device=DEVICE)
    return info.value.message


def test_runnable_curricula_pass_the_checks() -> None:
    finalize(config_from_mapping({**BASE, "curriculum_learning": LINEAR}), 1, device=DEVICE)
    finalize(config_from_mapping({**BASE, "curriculum_learning": DISCRETE, "pipe_parallel_size": 1}), 1, device=DEVICE)


def test_what_the_curriculum_cannot_do_is_refused_by_name() -> None:
    assert "max_difficulty=32 is longer than seq_length=16" in _refused(
        curriculum_learning={**LINEAR, "max_difficulty": 32})
    assert "custom needs a Python schedule function" in _refused(
        curriculum_learning={**LINEAR, "schedule_type": "custom"})
    assert "schedule_config.root_degree" in _refused(curriculum_learning={**ROOT, "schedule_config": {
        "total_curriculum_step": 9, "difficulty_step": 2}})
    assert "one more entry" in _refused(curriculum_learning={**DISCRETE, "schedule_config": {
        "difficulty": [4, 8], "max_step": [2, 4]}})
    assert "curriculum_type='vocab'" in _refused(curriculum_learning={**LINEAR, "curriculum_type": "vocab"})
    assert "train_impl='dpo'" in _refused(curriculum_learning=LINEAR, train_impl="dpo", dpo_reference_free=True)


def test_data_efficiency_parts_deepy_cannot_run_are_refused_by_name() -> None:
    sampling = {"enabled": True, "curriculum_learning": {"enabled": True, "curriculum_metrics": {
        "vocabularyrarity": {"index_to_sample_path": "x", "min_difficulty": 1, "max_difficulty": 2,
                             "schedule_type": "fixed_linear", "schedule_config": {}}}}}
    message = _refused(data_efficiency={"enabled": True, "data_sampling": sampling})
    assert "curriculum_metrics ['vocabularyrarity']" in message and "data analyzer" in message
    message = _refused(data_efficiency={"enabled": True, "data_routing": {"enabled": True, "random_ltd": {"enabled": True}}})
    assert "data_efficiency.data_routing" in message and "RandomLayerTokenDrop" in message
    message = _refused(data_efficiency={"enabled": True, "data_sampling": {
        "enabled": True, "dynamic_batching": {"enabled": True, "max_tokens": 64}}})
    assert "dynamic_batching" in message
    # a disabled block is accepted as it is (DeepSpeed's default)
    finalize(config_from_mapping({**BASE, "data_efficiency": {"enabled": False, "data_routing": {"enabled": True}}}), 1,
             device=DEVICE)


def test_deepspeed_blocks_stay_out_of_deepspeeds_config() -> None:
    """data_efficiency drives Deepy's loop, not DeepSpeed (which acts on it only in its own data loader); through
    deepspeed_extra_args it, and autotuning, are refused by name."""
    from megatron.neox_arguments.deepspeed_split import deepspeed_config

    block = {"enabled": True, "data_sampling": {"enabled": True, "curriculum_learning": {"enabled": True,
             "curriculum_metrics": {"seqlen_truncate": {k: v for k, v in LINEAR.items() if k != "enabled"}}}}}
    resolved = finalize(config_from_mapping({**BASE, "data_efficiency": block}), 1, device=DEVICE)
    assert "data_efficiency" not in deepspeed_config(resolved.args)
    for key in ("autotuning", "data_efficiency"):
        message = _refused(deepspeed_extra_args={key: {"enabled": True}})
        assert f"deepspeed_extra_args.{key}" in message


# --- no_save_optim: checkpoints without optimizer state ---------------------------------------------------------
def _adam_engine(seed: int) -> Any:
    """A tiny GPT in a real one-rank DeepSpeed engine with AdamW and an LR schedule (both hold state)."""
    import deepspeed

    from megatron.model import GPTConfig, GPTModel

    config = GPTConfig(num_layers=1, hidden_size=16, num_attention_heads=2, seq_length=8, padded_vocab_size=32,
                       seed=seed, no_weight_tying=True, precision="fp32")
    torch.manual_seed(seed)
    model = GPTModel(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=schedule,
                                      config={"train_batch_size": 2, "train_micro_batch_size_per_gpu": 2,
                                              "steps_per_print": 10**9})
    return engine


def _manager(**keys: Any) -> Any:
    from megatron.checkpointing.config import CheckpointArgs
    from megatron.checkpointing.manager import CheckpointManager
    from megatron.checkpointing.preemption import PreemptionWatcher

    return CheckpointManager.from_config(CheckpointArgs(**keys), args_record={}, train_iters=10,
                                         preemption=PreemptionWatcher())


def test_no_save_optim_writes_weights_only_and_loads_them_but_not_an_exact_resume(tmp_path: Any) -> None:
    """The checkpoint holds the module's weights (equal to the full checkpoint's) and no optimizer or LR-scheduler
    state, so it is smaller; finetune and no_load_optim start from those weights; a plain resume is refused by name."""
    from single_rank import init_single_rank_gloo

    from megatron import mpu
    from megatron.errors import CheckpointError

    init_single_rank_gloo()
    mpu.initialize_model_parallel(1, 0)
    try:
        engine = _adam_engine(seed=1)
        loss = engine(torch.arange(16).reshape(2, 8) % 30).float().pow(2).mean()
        engine.backward(loss)
        engine.step()  # Adam moments and a scheduler step to leave out
        _manager(save=str(tmp_path / "full"), checkpoint_factor=1).save(engine, step=1, consumed_samples=2)
        _manager(save=str(tmp_path / "weights"), checkpoint_factor=1, no_save_optim=True).save(
            engine, step=1, consumed_samples=2)
        full = torch.load(tmp_path / "full/global_step1/mp_rank_00_model_states.pt", weights_only=False)
        weights = torch.load(tmp_path / "weights/global_step1/mp_rank_00_model_states.pt", weights_only=False)
        assert full["optimizer"]["state"] and full["lr_scheduler"] is not None  # what the full checkpoint holds
        assert weights["optimizer"] is None and weights["lr_scheduler"] is None
        assert weights["module"].keys() == full["module"].keys()
        assert all(torch.equal(weights["module"][k], full["module"][k]) for k in full["module"])

        def size(path: Any) -> int:
            return sum(f.stat().st_size for f in path.rglob("*.pt"))

        assert size(tmp_path / "weights") < size(tmp_path / "full") * 0.6  # Adam's two moments per weight are gone
        trained = {k: v.clone() for k, v in engine.module.state_dict().items()}

        with pytest.raises(CheckpointError, match="no_save_optim: true .* cannot be resumed exactly"):
            _manager(load=str(tmp_path / "weights")).load(_adam_engine(seed=2))
        for keys, iteration in (({"finetune": True}, 0), ({"no_load_optim": True}, 1)):
            fresh = _adam_engine(seed=2)
            result = _manager(load=str(tmp_path / "weights"), **keys).load(fresh)
            assert result.iteration == iteration
            assert all(torch.equal(fresh.module.state_dict()[k], v) for k, v in trained.items())
            assert not fresh.optimizer.state  # the optimizer starts fresh
    finally:
        mpu.destroy_model_parallel()


def test_resuming_a_no_save_optim_checkpoint_exactly_is_refused_before_launch(tmp_path: Any) -> None:
    """deepy.py reads the checkpoint's deepy_meta.json (optimizer_saved: false) and refuses an exact resume or a
    layout change (exit 2, naming no_save_optim and the checkpoint); weights-only starts pass; ZeRO-3 is refused."""
    import json

    from tests.unit.test_resume_checks import refused, resolved, saved_checkpoint

    tag = saved_checkpoint(tmp_path / "run", no_save_optim=True)
    meta = json.loads((tag / "deepy_meta.json").read_text())
    (tag / "deepy_meta.json").write_text(json.dumps({**meta, "optimizer_saved": False}))
    config = resolved(load=str(tag.parent))
    message = refused(config)
    assert f"load ({config.provenance['load']}): {tag}: it was saved with no_save_optim: true" in message
    assert "finetune: true" in message and "no_load_optim: true" in message
    finalize(resolved(load=str(tag.parent), finetune=True), 1, device=DEVICE)
    finalize(resolved(load=str(tag.parent), no_load_optim=True), 1, device=DEVICE)
    assert "change of parallel layout" in refused(resolved(load=str(tag.parent), no_load_optim=True,
                                                           model_parallel_size=2, zero_stage=1), world=2)
    assert "no_save_optim=True (cfg.yml:" in refused(resolved(no_save_optim=True, zero_stage=3))


# --- deepspeed_activation_checkpointing: DeepSpeed's or torch's checkpoint -----------------------------------------
def test_the_chosen_checkpoint_recomputes_and_the_gradients_are_those_without_checkpointing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """checkpoint_activations with deepspeed_activation_checkpointing true runs the blocks under
    deepspeed.checkpointing.checkpoint (GPT-NeoX's), false under torch.utils.checkpoint.checkpoint; with dropout on,
    both give the gradients of the model run without checkpointing (the recompute draws the same masks)."""
    import deepspeed
    import torch.utils.checkpoint

    from single_rank import init_single_rank_gloo

    from megatron import mpu
    from megatron.engine.activation_config import ActivationCheckpointArgs
    from megatron.engine.build import configure_activation_checkpointing, forward_only_cleanup, wrap_layers
    from megatron.model import GPTConfig, GPTModel
    from megatron.mpu.random import model_parallel_manual_seed

    calls = {"deepspeed": 0, "torch": 0}
    ds_checkpoint, torch_checkpoint = deepspeed.checkpointing.checkpoint, torch.utils.checkpoint.checkpoint

    def counted(name: str, function: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return function(*args, **kwargs)
        return call

    monkeypatch.setattr(deepspeed.checkpointing, "checkpoint", counted("deepspeed", ds_checkpoint))
    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint", counted("torch", torch_checkpoint))
    init_single_rank_gloo()
    mpu.initialize_model_parallel(1, 0)
    try:
        config = GPTConfig(num_layers=2, hidden_size=16, num_attention_heads=2, seq_length=8, padded_vocab_size=32,
                           seed=4, no_weight_tying=True, precision="fp32", hidden_dropout=0.3, attention_dropout=0.3)
        tokens = torch.arange(16).reshape(2, 8) % 30

        def gradients(keys: dict[str, Any] | None) -> dict[str, torch.Tensor]:
            model_parallel_manual_seed(4)
            model = GPTModel(config)
            if keys is not None:
                cfg = ActivationCheckpointArgs(checkpoint_activations=True, **keys)
                configure_activation_checkpointing(cfg, config.arch.layers)
                wrap_layers(model, cfg, compile_layers=False, pipe_interval_used=False)
            model_parallel_manual_seed(11)  # the same dropout draws in every run
            model(tokens).float().pow(2).mean().backward()
            return {name: p.grad.clone() for name, p in model.named_parameters()}

        plain = gradients(None)
        assert calls == {"deepspeed": 0, "torch": 0}
        with_deepspeed = gradients({"deepspeed_activation_checkpointing": True})
        assert calls == {"deepspeed": 2, "torch": 0}  # one per block
        with_torch = gradients({"deepspeed_activation_checkpointing": False})
        assert calls == {"deepspeed": 2, "torch": 2}
    finally:
        mpu.destroy_model_parallel()
    assert plain.keys() == with_torch.keys() == with_deepspeed.keys()
    for name, grad in plain.items():
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(with_deepspeed[name], grad, rtol=1e-5, atol=1e-7, msg=name)
        torch.testing.assert_close(with_torch[name], grad, rtol=1e-5, atol=1e-7, msg=name)
    # after an evaluation forward GPT-NeoX resets DeepSpeed's checkpointing buffers (training.py evaluate); torch's
    # checkpoint keeps none
    on = ActivationCheckpointArgs(checkpoint_activations=True)
    assert forward_only_cleanup(on) is deepspeed.checkpointing.reset
    assert forward_only_cleanup(on.model_copy(update={"deepspeed_activation_checkpointing": False})) is None


def test_deepspeeds_checkpointing_options_need_deepspeeds_checkpoint() -> None:
    keys = {"checkpoint_activations": True, "deepspeed_activation_checkpointing": False}
    finalize(config_from_mapping({**BASE, **keys}), 1, device=DEVICE)
    message = _refused(**keys, partition_activations=True)
    assert "deepspeed_activation_checkpointing=False (<mapping>) recomputes with torch's checkpoint" in message
    assert "partition_activations=True" in message
    assert "activation_checkpointing.cpu_checkpointing=True" in _refused(
        **keys, activation_checkpointing={"cpu_checkpointing": True})
