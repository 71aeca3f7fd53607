"""GPT-NeoX model keys Deepy builds (docs/model_options.md): blocks sharing parameters (``num_unique_layers``,
``param_sharing_style``), the fp16 cross-entropy (``fp16_lm_cross_entropy``). Their tp=2 / pp=2 parity with one
rank is in ``tests/distributed/test_model_families_parallel.py`` (``shared_grouped``, ``shared_spread``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from gpt_configs import gpt_config
from megatron.config_rules import Device
from megatron.errors import ConfigError
from megatron.model import GPTModel, lm_loss
from megatron.neox_arguments import config_from_mapping
from megatron.neox_arguments.derived import finalize

BASE = dict(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=8, padded_vocab_size=64, seed=3,
            pos_emb="rotary")
LAUNCH = dict(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=8, train_iters=4, lr=1e-3,
              train_micro_batch_size_per_gpu=2, use_dummy_dataset=True, tokenizer_type="CharLevelTokenizer",
              pipe_parallel_size=0)
DEVICE = Device(cuda=False, fp16_supported=False)


def _refused(**keys: Any) -> str:
    with pytest.raises(ConfigError) as info:
        finalize(config_from_mapping({**LAUNCH, **keys}), 1, device=DEVICE)
    return info.value.message


def _batch(vocab: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randint(0, vocab, (2, 8), generator=gen), torch.randint(0, vocab, (2, 8), generator=gen)


# --- num_unique_layers / param_sharing_style ----------------------------------------------------------------------
@pytest.mark.parametrize(("style", "sets"), [("grouped", [0, 1, 0, 1]), ("spread", [0, 0, 1, 1]),
                                             ("spaced", [0, 0, 1, 1])])
def test_blocks_share_parameter_sets_in_the_help_texts_order(style: str, sets: list[int]) -> None:
    """GPT-NeoX's help text: num_layers=4, num_unique_layers=2 -> grouped [1, 2, 1, 2], spaced [1, 1, 2, 2]; the
    model has the parameters of a 2-block model, no more."""
    model = GPTModel(gpt_config(**BASE, num_unique_layers=2, param_sharing_style=style))
    modules = [id(layer) for layer in model.layers]
    assert [sorted(set(modules), key=modules.index).index(m) for m in modules] == sets
    two_blocks = GPTModel(gpt_config(**{**BASE, "num_layers": 2}))
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in two_blocks.parameters())
    assert sum(p.numel() for p in GPTModel(gpt_config(**BASE)).parameters()) > sum(
        p.numel() for p in model.parameters())


def test_a_shared_blocks_gradient_is_the_sum_over_its_positions() -> None:
    """Reference: the unshared 4-block model with the same weights at the shared positions; a shared parameter's
    gradient is the sum of those positions' gradients, and the loss is the same."""
    shared = GPTModel(gpt_config(**BASE, num_unique_layers=2))  # grouped: blocks 0, 2 and 1, 3
    plain = GPTModel(gpt_config(**BASE))
    with torch.no_grad():
        for i in range(4):
            for (_, mine), (_, theirs) in zip(shared.layers[i].named_parameters(), plain.layers[i].named_parameters()):
                theirs.copy_(mine)
        for (name, mine), (_, theirs) in zip(shared.named_parameters(), plain.named_parameters()):
            if not name.startswith("layers."):
                theirs.copy_(mine)
    tokens, labels = _batch()
    loss_shared, loss_plain = lm_loss(shared(tokens), labels), lm_loss(plain(tokens), labels)
    torch.testing.assert_close(loss_shared, loss_plain)
    loss_shared.backward()
    loss_plain.backward()
    for owner, other in ((0, 2), (1, 3)):
        for (name, p), (_, a), (_, b) in zip(shared.layers[owner].named_parameters(),
                                             plain.layers[owner].named_parameters(),
                                             plain.layers[other].named_parameters()):
            torch.testing.assert_close(p.grad, a.grad + b.grad, msg=lambda m: f"{name}: {m}")


@pytest.fixture()
def one_rank() -> Any:
    from single_rank import init_single_rank_gloo

    from megatron import mpu

    init_single_rank_gloo()
    mpu.initialize_model_parallel(1, 0)
    yield
    mpu.destroy_model_parallel()


def _engine(**keys: Any) -> Any:
    from megatron.engine.build import build_engine
    from megatron.neox_arguments.run_config import RunConfig

    resolved = finalize(config_from_mapping({**LAUNCH, "seed": 7, **keys}), 1, device=DEVICE)
    run = RunConfig.from_resolved(resolved)
    return build_engine(run, run.model.with_vocab(64), 4)


def test_shared_blocks_train_as_one_and_their_checkpoint_loads(one_rank: Any, tmp_path: Path) -> None:
    """Three steps of the real engine: the shared positions hold the same (changed) weights; the checkpoint (GPT-NeoX
    layout) has every position's layer, equal for shared positions, and loads into a fresh engine."""
    from megatron.checkpointing.config import CheckpointArgs
    from megatron.checkpointing.manager import CheckpointManager
    from megatron.checkpointing.preemption import PreemptionWatcher

    eng = _engine(num_unique_layers=2, param_sharing_style="spread")  # blocks 0, 1 and 2, 3
    start = {k: v.clone() for k, v in eng.engine.module.state_dict().items()}
    tokens, labels = _batch()
    for _ in range(3):
        loss = lm_loss(eng.engine(tokens), labels)
        eng.engine.backward(loss)
        eng.engine.step()
    state = eng.engine.module.state_dict()
    qkv = "attention.query_key_value.weight"
    assert not torch.equal(state[f"layers.0.{qkv}"], start[f"layers.0.{qkv}"])  # it trained
    assert torch.equal(state[f"layers.0.{qkv}"], state[f"layers.1.{qkv}"])
    assert not torch.equal(state[f"layers.1.{qkv}"], state[f"layers.2.{qkv}"])
    assert torch.equal(state[f"layers.2.{qkv}"], state[f"layers.3.{qkv}"])

    manager = CheckpointManager.from_config(CheckpointArgs(save=str(tmp_path), checkpoint_factor=1), args_record={},
                                            train_iters=10, preemption=PreemptionWatcher())
    manager.save(eng.engine, step=3, consumed_samples=6)
    saved = torch.load(tmp_path / "global_step3" / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    blocks = [f"sequential.{i}.{qkv}" for i in range(2, 6)]  # GPT-NeoX numbers the blocks from 2
    assert all(name in saved for name in blocks)
    assert torch.equal(saved[blocks[0]], saved[blocks[1]]) and torch.equal(saved[blocks[2]], saved[blocks[3]])

    fresh = _engine(num_unique_layers=2, param_sharing_style="spread", seed=8)
    assert not torch.equal(fresh.engine.module.state_dict()[f"layers.0.{qkv}"], state[f"layers.0.{qkv}"])
    CheckpointManager.from_config(CheckpointArgs(load=str(tmp_path)), args_record={}, train_iters=10,
                                  preemption=PreemptionWatcher()).load(fresh.engine)
    loaded = fresh.engine.module.state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in state.items())
    assert fresh.engine.module.layers[0] is fresh.engine.module.layers[1]  # still one module after loading


def test_what_sharing_cannot_do_is_refused_by_name() -> None:
    assert "num_unique_layers=3" in _refused(num_unique_layers=3)  # GPT-NeoX: num_layers divisible by it
    assert "num_unique_layers=8" in _refused(num_unique_layers=8)  # and not more than num_layers
    message = _refused(num_unique_layers=2, attention_config=[[["global", "local"], 2]], sliding_window_width=4,
                       param_sharing_style="spread")
    assert "layer 1 is 'local' but shares the parameters of layer 0 ('global')" in message
    message = _refused(num_unique_layers=2, checkpoint_activations=True, checkpoint_num_layers=2)
    assert "checkpoint_num_layers=2" in message
    finalize(config_from_mapping({**LAUNCH, "num_unique_layers": 2, "attention_config": [[["global", "local"], 2]],
                                  "sliding_window_width": 4}), 1, device=DEVICE)  # grouped: alike positions


# --- fp16_lm_cross_entropy ----------------------------------------------------------------------------------------
def _neox_fp16_cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """GPT-NeoX's ``_VocabParallelCrossEntropy.forward`` (``megatron/mpu/cross_entropy.py``, ea7aefd8) on one rank,
    step by step on fp16 logits as its ``cross_entropy(_fp16=True)`` hands them over."""
    logits = logits.clone()
    logits_max = torch.max(logits, dim=-1)[0]
    logits.sub_(logits_max.unsqueeze(dim=-1))
    logits_2d = logits.view(-1, logits.size()[-1])
    predicted = logits_2d[torch.arange(logits_2d.size()[0]), target.view(-1)].clone().view_as(target)
    exp_logits = logits
    torch.exp(logits, out=exp_logits)
    return torch.log(exp_logits.sum(dim=-1)) - predicted


def test_fp16_cross_entropy_is_gpt_neoxs_in_fp16(one_rank: Any) -> None:
    from megatron.objectives.lm import lm_loss_sum

    gen = torch.Generator().manual_seed(0)
    logits = (4 * torch.randn(2, 8, 64, generator=gen)).half().requires_grad_()
    labels = torch.randint(0, 64, (2, 8), generator=gen)
    labels[1, -2:] = -100
    counted = labels >= 0
    total, _ = lm_loss_sum(logits, labels, in_logits_dtype=True)
    neox = _neox_fp16_cross_entropy(logits.detach(), labels.clamp(min=0))
    assert neox.dtype == torch.float16
    torch.testing.assert_close(total, neox.float()[counted].sum(), rtol=0, atol=0)
    fp32, _ = lm_loss_sum(logits, labels)  # the default: fp32 from the same logits
    exact = torch.nn.functional.cross_entropy(logits.detach().float().view(-1, 64), labels.view(-1), reduction="sum")
    assert abs(float(fp32.detach()) - float(exact)) < 1e-4 < abs(float(total.detach()) - float(exact))  # fp16's rounding shows
    total.backward()
    softmax = torch.softmax(logits.detach().float(), dim=-1)
    expected = (softmax - torch.nn.functional.one_hot(labels.clamp(min=0), 64)) * counted[..., None]
    torch.testing.assert_close(logits.grad.float(), expected, atol=2e-3, rtol=0)


def test_the_engine_hands_the_key_to_the_objective(one_rank: Any) -> None:
    # the run's precision check is before launch (below); the engine itself builds in fp32 on this CPU
    from megatron.engine.build import build_engine
    from megatron.neox_arguments.run_config import RunConfig

    resolved = finalize(config_from_mapping({**LAUNCH, "num_layers": 1}), 1, device=DEVICE)
    run = RunConfig.from_resolved(resolved)
    for flag in (True, False):
        eng = build_engine(run, run.model.with_vocab(64).replace(fp16_lm_cross_entropy=flag), 4)
        assert eng.objective.fp16_cross_entropy is flag


def test_fp16_cross_entropy_outside_fp16_is_refused_before_launch() -> None:
    message = _refused(fp16_lm_cross_entropy=True, precision="bfloat16", bf16={"enabled": True})
    assert "fp16_lm_cross_entropy=True" in message and "fp16 mode only" in message
    assert "fp16_lm_cross_entropy=True" in _refused(fp16_lm_cross_entropy=True)  # fp32
    assert "z_loss" in _refused(fp16_lm_cross_entropy=True, fp16={"enabled": True}, z_loss=0.1)


# --- soft_prompt_tuning -------------------------------------------------------------------------------------------
PROMPT = {"enabled": True, "n_tokens": 3, "init_range": 0.5}


def _direct_prompted_logits(model: GPTModel, prompt: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The reference: the blocks of ``model`` run on [prompt embeddings; token embeddings] (positions 0..n+s-1),
    the prompt's outputs left out, then the final norm and the tied head, written out here."""
    x = model.embedding(tokens)  # [s, b, h]
    x = torch.cat([prompt.unsqueeze(1).expand(-1, tokens.shape[0], -1), x], dim=0)  # [n + s, b, h]
    for layer in model.layers:
        x = layer(x)
    x = model.final_norm(x[prompt.shape[0]:])
    return (x @ model.embedding.word_embeddings.weight.t()).transpose(0, 1)  # [b, s, v]


def test_the_prompted_model_is_the_model_run_on_prompt_then_tokens() -> None:
    prompted = GPTModel(gpt_config(**BASE, soft_prompt_tuning=PROMPT))
    assert prompted.soft_prompt is not None
    assert tuple(prompted.soft_prompt.weight.shape) == (3, 32) and float(prompted.soft_prompt.weight.detach().abs().max()) <= 0.5
    tokens, labels = _batch()
    logits = prompted(tokens)
    assert tuple(logits.shape) == (2, 8, 64)  # one prediction per token, none for the prompt
    torch.testing.assert_close(logits, _direct_prompted_logits(prompted, prompted.soft_prompt.weight, tokens))
    plain = GPTModel(gpt_config(**BASE))  # the same weights: the prompt changes what the model predicts
    assert not torch.allclose(lm_loss(plain(tokens), labels), lm_loss(logits, labels))
    assert GPTModel(gpt_config(**BASE, soft_prompt_tuning={**PROMPT, "enabled": False})).soft_prompt is None


def _one_step_changes(eng: Any, pipe: bool) -> tuple[float, dict[str, bool]]:
    from megatron.objectives.base import MicroBatch

    tokens, labels = _batch()
    before = {n: p.detach().clone() for n, p in eng.engine.module.named_parameters()}
    if pipe:
        batch = MicroBatch(tokens, labels, units=float(labels.numel()))
        loss = eng.engine.train_batch(iter([(batch.pipe_inputs(), batch.targets(float(labels.numel())))]))
    else:
        loss = lm_loss(eng.engine(tokens), labels)
        eng.engine.backward(loss)
        eng.engine.step()
    after = dict(eng.engine.module.named_parameters())
    return float(loss), {n: not torch.equal(before[n], after[n].detach()) for n in before}


@pytest.mark.parametrize("pipe", [0, 1])
def test_only_the_prompt_trains_and_the_loss_is_the_direct_one(pipe: int, tmp_path: Path) -> None:
    """A real engine (a plain module, and DeepSpeed's PipelineModule of one stage): after a step only the prompt's
    weights changed; the step's loss is the reference model's on [prompt; tokens]; init_string starts the prompt
    from its tokens' embeddings (cut to n_tokens)."""
    from single_rank import init_single_rank_gloo

    from megatron import mpu

    init_single_rank_gloo()
    mpu.initialize_model_parallel(1, pipe)
    try:
        prompt_ids = [5, 9, 11, 2]
        eng = _engine(soft_prompt_tuning={**PROMPT, "init_string": "abcd"}, pipe_parallel_size=pipe, lr=0.1)
        module = eng.engine.module
        if pipe:
            embedding = module.tied_modules.embed
            prompt = embedding.soft_prompt.weight
        else:
            embedding, prompt = module.embedding, module.soft_prompt.weight
        assert [n for n, p in module.named_parameters() if p.requires_grad] == [
            "tied_modules.embed.soft_prompt.weight" if pipe else "soft_prompt.weight"]
        reference = GPTModel(eng.config.replace(soft_prompt_tuning=None))
        reference.load_state_dict({k: v for k, v in _plain_state(module, pipe).items()})
        tokens, labels = _batch()
        expected = lm_loss(_direct_prompted_logits(reference, prompt.detach(), tokens), labels)
        loss, changed = _one_step_changes(eng, bool(pipe))
        assert abs(loss - float(expected)) < 1e-5, (loss, float(expected))
        assert [n for n, moved in changed.items() if moved] == [
            "tied_modules.embed.soft_prompt.weight" if pipe else "soft_prompt.weight"]
        # init_string: a fresh engine's prompt is the embeddings of the string's first n_tokens tokens
        fresh = GPTModel(eng.config)
        from megatron.model.soft_prompt import prepare_soft_prompt

        prepare_soft_prompt(fresh, prompt_ids)
        assert fresh.soft_prompt is not None
        torch.testing.assert_close(fresh.soft_prompt.weight, fresh.embedding.word_embeddings.weight[prompt_ids[:3]])
        del embedding
    finally:
        mpu.destroy_model_parallel()


def _plain_state(module: Any, pipe: int) -> dict[str, torch.Tensor]:
    from megatron.model.pipeline import model_parameter_name

    state = module.state_dict()
    if not pipe:
        return {k: v for k, v in state.items() if not k.startswith("soft_prompt.")}
    out = {model_parameter_name(k): v for k, v in state.items() if "soft_prompt" not in k}
    return out


def test_what_the_soft_prompt_cannot_do_is_refused_by_name() -> None:
    assert "num_tokens" in _refused(soft_prompt_tuning={"enabled": True, "num_tokens": 4})
    assert "n_tokens must be" in _refused(soft_prompt_tuning={"enabled": True, "n_tokens": 0})
    assert "pipe_parallel_size=2" in _refused(soft_prompt_tuning=PROMPT, pipe_parallel_size=2, num_gpus=2)
    assert "reset_attention_mask=True" in _refused(soft_prompt_tuning=PROMPT, reset_attention_mask=True)
    finalize(config_from_mapping({**LAUNCH, "soft_prompt_tuning": PROMPT}), 1, device=DEVICE)


# --- mamba_selective_fp32_params ----------------------------------------------------------------------------------
MAMBA = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=8, padded_vocab_size=64, seed=3,
             attention_config=[[["mamba"], 2]], pos_emb="none", precision="bfloat16")


@pytest.mark.parametrize("fp32", [True, False])
def test_mamba_a_log_and_d_are_fp32_only_when_asked(fp32: bool) -> None:
    model = GPTModel(gpt_config(**MAMBA, mamba_selective_fp32_params=fp32))
    kept = {n: p.dtype for n, p in model.named_parameters() if n.endswith(("mixer.A_log", "mixer.D"))}
    assert len(kept) == 4 and set(kept.values()) == {torch.float32 if fp32 else torch.bfloat16}
    others = {p.dtype for n, p in model.named_parameters() if n not in kept}
    assert others == {torch.bfloat16}
    out = model(torch.randint(0, 64, (1, 8)))
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()


def test_deepspeed_casts_every_parameter_so_training_in_half_precision_refuses_fp32_ones(one_rank: Any) -> None:
    """The reason for the refusal, read from DeepSpeed 0.19.8 itself: its bf16 engine turns the fp32 A_log into bf16."""
    import deepspeed

    model = GPTModel(gpt_config(**MAMBA))
    assert model.layers[0].mixer.A_log.dtype == torch.float32
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.1),
                                      config={"train_batch_size": 1, "train_micro_batch_size_per_gpu": 1,
                                              "bf16": {"enabled": True}, "steps_per_print": 10**9})
    assert engine.module.layers[0].mixer.A_log.dtype == torch.bfloat16
    mamba = {**LAUNCH, "attention_config": [[["mamba"], 4]], "pos_emb": "none", "precision": "bfloat16",
             "bf16": {"enabled": True}}
    with pytest.raises(ConfigError, match="mamba_selective_fp32_params=True .* DeepSpeed 0.19.8 casts every"):
        finalize(config_from_mapping({**mamba, "mamba_selective_fp32_params": True}), 1, device=DEVICE)
    warned = finalize(config_from_mapping(mamba), 1, device=DEVICE)  # GPT-NeoX's default: said, not refused
    assert any("mamba_selective_fp32_params=True (default)" in w for w in warned.warnings)
    quiet = finalize(config_from_mapping({**mamba, "mamba_selective_fp32_params": False}), 1, device=DEVICE)
    assert not any("mamba_selective_fp32_params" in w for w in quiet.warnings)
    finalize(config_from_mapping({**mamba, "precision": "fp32", "bf16": {"enabled": False},
                                  "mamba_selective_fp32_params": True}), 1, device=DEVICE)


def test_a_language_model_checkpoint_starts_a_prompted_model(one_rank: Any, tmp_path: Path) -> None:
    """finetune from a checkpoint without a prompt: every weight loads, the prompt keeps its initialisation (the
    prefix pretrain hands the checkpoint loader as new)."""
    from megatron.checkpointing.config import CheckpointArgs
    from megatron.checkpointing.manager import CheckpointManager
    from megatron.checkpointing.preemption import PreemptionWatcher
    from megatron.model.soft_prompt_settings import PROMPT_NAME

    plain = _engine()
    CheckpointManager.from_config(CheckpointArgs(save=str(tmp_path), checkpoint_factor=1), args_record={},
                                  train_iters=10, preemption=PreemptionWatcher()).save(plain.engine, step=1,
                                                                                       consumed_samples=2)
    prompted = _engine(soft_prompt_tuning=PROMPT, seed=9)
    start = prompted.engine.module.soft_prompt.weight.detach().clone()
    result = CheckpointManager.from_config(CheckpointArgs(load=str(tmp_path), finetune=True), args_record={},
                                           train_iters=10, preemption=PreemptionWatcher(),
                                           new_parameters=(f"{PROMPT_NAME}.",)).load(prompted.engine)
    assert result.loaded and "new parameters start from their initialisation: soft_prompt.weight" in result.notes
    loaded = prompted.engine.module.state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in plain.engine.module.state_dict().items())
    assert torch.equal(loaded["soft_prompt.weight"], start)


def test_shared_blocks_in_a_pipeline_module_train_save_and_load(tmp_path: Path) -> None:
    """DeepSpeed's PipelineModule (one stage): a shared set is one tied module at all its positions; after a step
    its weights moved; the per-layer checkpoint files of its positions hold equal weights and load back."""
    from single_rank import init_single_rank_gloo

    from megatron import mpu
    from megatron.checkpointing.config import CheckpointArgs
    from megatron.checkpointing.manager import CheckpointManager
    from megatron.checkpointing.preemption import PreemptionWatcher
    from megatron.objectives.base import MicroBatch

    init_single_rank_gloo()
    mpu.initialize_model_parallel(1, 1)
    try:
        eng = _engine(num_unique_layers=2, pipe_parallel_size=1)  # grouped: positions 0, 2 and 1, 3
        names = sorted(n for n, _ in eng.engine.module.named_parameters())
        assert any(n.startswith("tied_modules.shared_block_0.") for n in names)
        assert not any(n.split(".")[0].isdigit() and "attention" in n for n in names)  # no unshared block left
        start = {n: p.detach().clone() for n, p in eng.engine.module.named_parameters()}
        tokens, labels = _batch()
        batch = MicroBatch(tokens, labels, units=float(labels.numel()))
        eng.engine.train_batch(iter([(batch.pipe_inputs(), batch.targets(float(labels.numel())))]))
        trained = {n: p.detach().clone() for n, p in eng.engine.module.named_parameters()}
        assert not torch.equal(trained["tied_modules.shared_block_0.attention.dense.weight"],
                               start["tied_modules.shared_block_0.attention.dense.weight"])
        CheckpointManager.from_config(CheckpointArgs(save=str(tmp_path), checkpoint_factor=1), args_record={},
                                      train_iters=10, preemption=PreemptionWatcher()).save(eng.engine, step=1,
                                                                                           consumed_samples=2)
        files = sorted(p.name for p in (tmp_path / "global_step1").glob("layer_*-model_states.pt"))
        blocks = [torch.load(tmp_path / "global_step1" / f"layer_{i:02d}-model_00-model_states.pt") for i in
                  range(2, 6)]  # GPT-NeoX numbers the blocks 2..L+1
        assert len(files) >= 6, files
        for a, b in ((0, 2), (1, 3)):
            assert torch.equal(blocks[a]["attention.dense.weight"], blocks[b]["attention.dense.weight"])
        fresh = _engine(num_unique_layers=2, pipe_parallel_size=1, seed=8)
        CheckpointManager.from_config(CheckpointArgs(load=str(tmp_path)), args_record={}, train_iters=10,
                                      preemption=PreemptionWatcher()).load(fresh.engine)
        assert all(torch.equal(p.detach(), trained[n]) for n, p in fresh.engine.module.named_parameters())
    finally:
        mpu.destroy_model_parallel()
