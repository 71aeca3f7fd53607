"""Each feature's hooks (``megatron/training/features/``), built from a run's keys on a real one-rank DeepSpeed engine:
off, the builder returns None; on, each hook does its feature's work. And ``pretrain`` stays the wiring of its
phases."""

from __future__ import annotations

import inspect
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from tokenizers import Tokenizer as HFJson
from tokenizers import models

from megatron.checkpointing.config import CheckpointArgs
from megatron.checkpointing.manager import CheckpointHooks, CheckpointManager
from megatron.checkpointing.preemption import PreemptionWatcher
from megatron.engine.build import Engine
from megatron.model import GPTConfig, GPTModel
from megatron.model.lora_config import LoRAArgs
from megatron.neox_arguments import NeoXArgs
from megatron.neox_arguments.run_config import RunConfig
from megatron.tokenizer.hf import HFBackedTokenizer
from megatron.training.features import FEATURES, build_hooks
from megatron.training.features.base import Setup
from megatron.training.loop import Hooks, LoopHooks, TrainState

VOCAB = [f"w{i}" for i in range(36)] + ["<|endoftext|>", "<|eot_id|>"]
MODEL = dict(num_layers=1, hidden_size=16, num_attention_heads=2, seq_length=8, padded_vocab_size=64, seed=5,
             no_weight_tying=True, precision="fp32")  # fmt: skip
LORA = dict(lora_r=2, lora_target_modules=["query_key_value", "dense"])
TRAIN_ITERS = 4


@pytest.fixture(scope="module", autouse=True)
def one_rank() -> Any:
    """This process as a world of one rank, its model-parallel groups (tp 1, no pipeline) made."""
    from single_rank import init_single_rank_gloo

    from megatron import mpu

    init_single_rank_gloo()
    mpu.initialize_model_parallel(1, 0)
    yield
    mpu.destroy_model_parallel()


def _run(**keys: Any) -> RunConfig:
    """A run whose keys are ``keys`` (the batch sizes resolved as deepy.py would)."""
    deepspeed_config = keys.pop("deepspeed_config", {})
    args = NeoXArgs(**{**MODEL, "train_iters": TRAIN_ITERS, "train_batch_size": 2, "train_micro_batch_size_per_gpu": 2,
                       "gradient_accumulation_steps": 1, "tokenizer_type": "HFTokenizer", **keys})
    return RunConfig.from_args(args, deepspeed_config)


def _engine(lora: bool = False) -> Engine:
    """A tiny GPT model in a real DeepSpeed engine (AdamW, fp32, ZeRO 0), with LoRA adapters when ``lora``."""
    import deepspeed

    from megatron.model.lora import apply_lora

    config = GPTConfig(**MODEL)
    torch.manual_seed(0)
    model = GPTModel(config)
    adapters = apply_lora(model, LoRAArgs(**LORA), config.seed) if lora else []  # type: ignore[arg-type]
    trained = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(trained, lr=0.1),
                                      config={"train_batch_size": 2, "train_micro_batch_size_per_gpu": 2,
                                              "steps_per_print": 10**9})
    return Engine(engine=engine, optimizer=engine.optimizer, lr_scheduler=None, config=config,  # type: ignore[arg-type]
                  is_pipe=False, ds_config={}, adapters=adapters)


def _tokenizer() -> HFBackedTokenizer:
    return HFBackedTokenizer(HFJson(models.WordLevel({t: i for i, t in enumerate(VOCAB)}, unk_token="w0")), fast=False)


def _setup(eng: Engine, tmp_path: Path, said: list[str] | None = None, **changes: Any) -> Setup:
    """What ``pretrain`` hands the builders: checkpoints saved every 2 steps into ``tmp_path/ckpt``."""
    keys = CheckpointArgs(save=str(tmp_path / "ckpt"), checkpoint_factor=2)
    manager = CheckpointManager.from_config(keys, args_record={}, train_iters=TRAIN_ITERS, preemption=PreemptionWatcher())
    values: dict[str, Any] = dict(eng=eng, tokenizer=_tokenizer(), checkpoint_keys=keys,
                                  checkpoints=CheckpointHooks(manager), zero_stage=0, train_iters=TRAIN_ITERS,
                                  say=(said if said is not None else []).append, metrics_dir=str(tmp_path / "logs"))
    return Setup(**{**values, **changes})


def _step(eng: Engine, hooks: Hooks | None = None, loss_scale: float = 1.0) -> None:
    """One real optimizer step on a fixed batch; ``hooks``: told the loss before the update, as the loop does."""
    tokens = torch.arange(16).reshape(2, 8) % 30
    loss = eng.engine(tokens).float().pow(2).mean() * loss_scale
    eng.engine.backward(loss)
    if hooks is not None and hooks.want_loss:
        hooks.before_update(loss.detach())
    eng.engine.step()


def _only(hooks: Hooks) -> LoopHooks:
    assert len(hooks.features) == 1
    return hooks.features[0]


def test_pretrain_is_the_wiring_of_its_phases() -> None:
    """``pretrain`` (def line to last line) stays at most 60 lines: each feature is a builder in FEATURES."""
    from megatron.training.pretrain import pretrain

    lines = inspect.getsource(pretrain).rstrip("\n").splitlines()
    assert len(lines) <= 60, f"pretrain is {len(lines)} lines"
    source = inspect.getsource(pretrain)
    for name in ("ema_beta", "ModelAverage", "BadStepGate", "PeftSaves", "HFSaves", "StragglerWatch", "CommsReport",
                 "reinit_tokens"):
        assert name not in source, f"pretrain names a feature ({name}): it belongs in features/"


def test_off_by_default_only_checkpoints_and_the_straggler_watch(tmp_path: Path) -> None:
    """A run that names no feature gets the checkpoints' hooks and the straggler watch (``straggler_factor`` 1.5 by
    default), in FEATURES' order."""
    from megatron.training.stragglers import LOCAL

    hooks = build_hooks(_run(), _setup(_engine(), tmp_path))
    LOCAL.enabled = False
    assert [h.name for h in hooks.features] == ["checkpoints", "stragglers"]
    assert hooks.eval_weights is None and hooks.evaluations == [] and not hooks.want_loss
    assert [build.__name__ for build in FEATURES][:3] == ["build_checkpoints", "build_reinit_tokens", "build_averaging"]


def test_checkpoints_hook_saves_at_its_steps_and_the_last_one(tmp_path: Path) -> None:
    from megatron.training.features.checkpoints import build_checkpoints

    eng = _engine()
    hooks = Hooks([build_checkpoints(_run(), _setup(eng, tmp_path))])
    state = TrainState()
    for state.iteration in (1, 2, 3):
        state.consumed_samples = 2 * state.iteration
        assert hooks.after_step(eng, state) is False
    hooks.at_exit(eng, state)  # the last step (3), not a multiple of checkpoint_factor, saved at exit
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("global_step*")) == ["global_step2", "global_step3"]


def test_averaging_hook_updates_after_each_step_is_saved_evaluated_and_resumed(tmp_path: Path) -> None:
    """ema_beta: the average starts at the weights (``resume``), moves after each step (``after_update``) before
    the step's checkpoint (which holds it), is swapped in for evaluations and read back by a resumed run."""
    from megatron.training.features.averaging import build_averaging
    from megatron.training.features.checkpoints import build_checkpoints
    from megatron.training.model_averaging import EMA_DIR

    assert build_averaging(_run(), _setup(_engine(), tmp_path)) is None
    eng, beta = _engine(), 0.75
    setup = _setup(eng, tmp_path)
    hooks = build_hooks(_run(ema_beta=beta), setup, [build_checkpoints, build_averaging])
    assert [h.name for h in hooks.features] == ["checkpoints", "ema"] and hooks.eval_weights is not None
    module = eng.engine.module
    state = TrainState()
    hooks.resume(eng, state)
    start = {name: p.detach().clone() for name, p in module.named_parameters()}
    for state.iteration in (1, 2):
        _step(eng)
        hooks.after_update(eng, state)
        hooks.after_step(eng, state)
    hooks.at_exit(eng, state)
    now = {name: p.detach().clone() for name, p in module.named_parameters()}
    average = hooks.eval_weights.whole(True)
    name = "embedding.word_embeddings.weight"
    assert not torch.equal(average[name], now[name]) and not torch.equal(average[name], start[name])
    saved = torch.load(tmp_path / "ckpt" / "global_step2" / EMA_DIR / "tp00_pp00.pt", weights_only=True)
    assert torch.equal(saved["average"][name], average[name])  # the step's checkpoint holds the step's average
    with hooks.eval_weights.swapped_in():
        assert torch.equal(module.get_parameter(name).detach(), average[name])
    assert torch.equal(module.get_parameter(name).detach(), now[name])

    resumed = _setup(eng, tmp_path / "resumed")
    resumed.checkpoints.manager.resumed_from = tmp_path / "ckpt" / "global_step2"
    again = build_hooks(_run(ema_beta=beta), resumed, [build_averaging])
    again.resume(eng, TrainState(iteration=2))
    assert again.eval_weights is not None and torch.equal(again.eval_weights.whole(True)[name], average[name])


def test_bad_steps_hook_skips_a_spike_keeps_its_window_in_the_state_and_counts_it(tmp_path: Path) -> None:
    from megatron.training.bad_steps import BadStepRule
    from megatron.training.features.bad_steps import build_bad_steps

    assert build_bad_steps(_run(), _setup(_engine(), tmp_path)) is None
    eng = _engine()
    hooks = Hooks([build_bad_steps(_run(skip_bad_steps_window=4), _setup(eng, tmp_path))])  # type: ignore[list-item]
    saved = BadStepRule(window=4, sigma=6.0)
    for loss in (1.0, 1.0, 1.0):
        saved.judge(loss, 1.0)
    state = TrainState(iteration=3, bad_steps=saved.to_dict())
    hooks.resume(eng, state)  # the window a checkpoint stored
    weights = [p.detach().clone() for p in eng.engine.module.parameters()]
    _step(eng, hooks, loss_scale=1e6)  # far above the window: no update
    state.iteration += 1
    hooks.after_update(eng, state)
    assert all(torch.equal(a, b) for a, b in zip(weights, eng.engine.module.parameters()))
    assert hooks.log_metrics(eng, state) == {"train/skipped_bad_steps": 1}
    assert state.bad_steps is not None and len(state.bad_steps["losses"]) == 4  # saved with the step's checkpoint


def test_reinit_hook_redraws_the_rows_at_step_0_only(tmp_path: Path) -> None:
    from megatron.training.features.reinit import build_reinit_tokens

    assert build_reinit_tokens(_run(), _setup(_engine(), tmp_path)) is None
    eng = _engine()
    hooks = Hooks([build_reinit_tokens(_run(reinit_tokens=["<|eot_id|>"]), _setup(eng, tmp_path))])  # type: ignore[list-item]
    row = VOCAB.index("<|eot_id|>")
    embedding = eng.engine.module.embedding.word_embeddings.weight
    before = embedding.detach().clone()
    hooks.resume(eng, TrainState(iteration=5))  # a resumed run keeps its rows
    assert torch.equal(embedding.detach(), before)
    hooks.resume(eng, TrainState(iteration=0))
    assert not torch.equal(embedding[row].detach(), before[row])
    assert torch.equal(embedding[:row].detach(), before[:row])


def test_straggler_hook_times_each_step_and_judges_at_log_steps(tmp_path: Path) -> None:
    from megatron.training.features.stragglers import build_stragglers
    from megatron.training.stragglers import LOCAL, timed

    assert build_stragglers(_run(straggler_factor=None), _setup(_engine(), tmp_path)) is None
    eng = _engine()
    hooks = Hooks([build_stragglers(_run(straggler_window=2), _setup(eng, tmp_path))])  # type: ignore[list-item]
    try:
        assert LOCAL.enabled  # the step's own work is timed from now on
        timed(lambda: time.sleep(0.01))
        state = TrainState(iteration=1)
        hooks.after_update(eng, state)
        assert LOCAL.seconds == 0.0  # the step's time went into the watch's window
        assert hooks.log_metrics(eng, state) == {}  # one rank: no one to be slower than
    finally:
        LOCAL.enabled = False


def test_comms_hook_shows_deepspeeds_summary_at_exit_and_with_verbose_at_log_steps(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import deepspeed.comm

    from megatron.training.features.comms import build_comms_report

    eng = _engine()
    assert build_comms_report(_run(), _setup(eng, tmp_path)) is None
    off = _run(deepspeed_config={"comms_logger": {"enabled": False, "verbose": True}})
    assert build_comms_report(off, _setup(eng, tmp_path)) is None
    run = _run(log_interval=2, deepspeed_config={"comms_logger": {"enabled": True, "verbose": True}})
    hooks = Hooks([build_comms_report(run, _setup(eng, tmp_path))])  # type: ignore[list-item]
    deepspeed.comm.configure(enabled=True, prof_all=True)  # what DeepSpeed's engine does with the block
    try:
        deepspeed.comm.all_reduce(torch.ones(3))
        capsys.readouterr()
        assert hooks.after_step(eng, TrainState(iteration=1)) is False
        assert "Comm. Op" not in capsys.readouterr().out
        hooks.after_step(eng, TrainState(iteration=2))
        assert "Comm. Op" in capsys.readouterr().out
        hooks.at_exit(eng, TrainState(iteration=3))
        assert "all_reduce" in capsys.readouterr().out
    finally:
        deepspeed.comm.configure(enabled=False)


class _Tasks:
    """``train.py``'s lm-eval runner (``TasksInTraining``): built on the engine, its run reads the module."""

    def __init__(self, interval: int | None) -> None:
        self.interval = interval
        self.built: list[tuple[int, bool]] = []

    def __call__(self, eng: Any, tokenizer: Any, zero_stage: int, sequence_parallel: bool) -> _Tasks:
        self.built.append((zero_stage, sequence_parallel))
        self.eng = eng
        return self

    def run(self) -> dict[str, float]:
        return {"lm_eval/t/acc": float(self.eng.engine.module.embedding.word_embeddings.weight.detach().sum())}


@pytest.mark.parametrize("interval, due", [(None, [4, 7]), (3, [3, 6, 7])])
def test_tasks_hook_runs_at_its_interval_and_after_the_last_step(tmp_path: Path, interval: int | None,
                                                                 due: list[int]) -> None:
    from megatron.training.features.tasks import build_tasks

    eng = _engine()
    assert build_tasks(_run(), _setup(eng, tmp_path)) is None
    tasks = _Tasks(interval)
    hooks = build_tasks(_run(eval_interval=4), _setup(eng, tmp_path, task_evaluation=tasks, zero_stage=1))
    assert hooks is not None and hooks.evaluation is not None and tasks.built == [(1, False)]
    assert [it for it in range(1, 8) if hooks.evaluation.due(it, it == 7)] == due
    weight = eng.engine.module.embedding.word_embeddings.weight
    assert hooks.evaluation.run() == {"lm_eval/t/acc": pytest.approx(float(weight.detach().sum()))}


def test_peft_saves_hook_writes_the_adapters_at_its_steps_and_a_missing_one_on_resume(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from megatron.training.features.peft import build_peft_saves

    assert build_peft_saves(_run(**LORA), _setup(_engine(lora=True), tmp_path)) is None
    eng = _engine(lora=True)
    run = _run(**LORA, lora_peft_save_path=str(tmp_path / "peft"), lora_peft_save_interval=2)
    hooks = Hooks([build_peft_saves(run, _setup(eng, tmp_path))])  # type: ignore[list-item]
    state = TrainState()
    hooks.resume(eng, state)
    for state.iteration in (1, 2, 3):
        hooks.after_step(eng, state)
    assert sorted(p.name for p in (tmp_path / "peft").iterdir()) == ["step-2"]  # Levanter's 0-based step 2
    saved = load_file(str(tmp_path / "peft" / "step-2" / "adapter_model.safetensors"))
    assert saved and all("lora_" in name for name in saved)
    hooks.at_exit(eng, state)  # nothing more: step 3 (0-based 2) is written
    (tmp_path / "peft" / "step-2").rename(tmp_path / "peft" / ".step-2.partial-0123abcd")  # killed while writing
    again = Hooks([build_peft_saves(run, _setup(eng, tmp_path))])  # type: ignore[list-item]
    again.resume(eng, TrainState(iteration=3))  # its step's checkpoint was committed: written again from it
    assert sorted(p.name for p in (tmp_path / "peft").iterdir()) == ["step-2"]


def test_hf_saves_hook_writes_the_ema_weights_and_needs_the_writer(tmp_path: Path) -> None:
    """hf_save_path: rank 0's writer gets the model's weights, the EMA's in place of the trained ones when the
    averaging feature came before it; without a writer (a program other than train.py) it is refused."""
    from megatron.errors import ConfigError
    from megatron.training.features.averaging import build_averaging
    from megatron.training.features.hf import build_hf_saves

    eng = _engine()
    assert build_hf_saves(_run(), _setup(eng, tmp_path)) is None
    run = _run(hf_save_path=str(tmp_path / "hf"), hf_save_interval=1, ema_beta=0.5)
    with pytest.raises(ConfigError, match="hf_save_path"):
        build_hf_saves(run, _setup(eng, tmp_path))
    written: dict[str, dict[str, torch.Tensor]] = {}
    made: list[torch.dtype] = []

    def writer_for(config: GPTConfig, tokenizer: Any, dtype: torch.dtype, lora_scale: float | None) -> Any:
        made.append(dtype)

        def write(weights: Any, out_dir: Path) -> None:
            torch.save(dict(weights), out_dir / "weights.pt")
            written[out_dir.name] = dict(weights)
        return write

    hooks = build_hooks(run, _setup(eng, tmp_path, hf_writer=writer_for), [build_averaging, build_hf_saves])
    assert [h.name for h in hooks.features] == ["ema", "hf_save_path"] and made == [torch.float32]
    state = TrainState()
    hooks.resume(eng, state)
    _step(eng)
    for state.iteration in (1, 2):
        hooks.after_update(eng, state)
        hooks.after_step(eng, state)
    assert hooks.eval_weights is not None
    average, saved = hooks.eval_weights.whole(True), torch.load(tmp_path / "hf" / "step-1" / "weights.pt")
    name = "embedding.word_embeddings.weight"
    assert torch.equal(saved[name], average[name])
    assert not torch.equal(saved[name], eng.engine.module.get_parameter(name).detach())
