"""GPTModel at tp=2 (and as pp=2 pipeline stages) equals tp=1 on 2 real gloo ranks.

Each rank first builds and runs the tp=1 model (no model-parallel groups yet), then the same
config at tp=2, and compares: initial full weights (exactly), logits, loss, every full
gradient, and the logits of token-by-token decoding with a KV cache. All parameters get the same layout-independent random perturbation first so that norm
gains and biases matter. Then the ranks switch to pp=2 and run `pipeline_layer_specs` as two
DeepSpeed `PipelineModule` stages, passing the activation by hand.

Through DeepSpeed's engine at tp=2 with sequence parallelism (the norms' gradients partial per rank),
one SGD step (lr 1, two micro-batches) on each optimizer path - no ZeRO, ZeRO-2, ZeRO-1 in bf16
(DeepSpeed's bf16 optimizer) - moves every weight by the tp=1 gradient, with one tp all-reduce for
all partial gradients per step and none in the backward. Last, at dp=2: a bf16 ZeRO-1 checkpoint
written the way Deepy configured DeepSpeed before issue 33 (bf16 gradient accumulation: DeepSpeed's
ZeRO-1 optimizer) loads into today's bf16 optimizer bit for bit. One spawn for everything.
"""

from __future__ import annotations

import faulthandler
import os
import traceback
import zlib
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from rank_harness import finish_rank, run_ranks

WORLD = 2
BASE = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=8, padded_vocab_size=64, seed=3)
CONFIGS: dict[str, dict[str, Any]] = {
    "mha_learned": dict(),
    "gqa_rotary_swiglu": dict(num_kv_heads=2, pos_emb="rotary", rotary_pct=0.5, activation="swiglu", norm="rmsnorm",
                              intermediate_size=384),  # GPT-NeoX's gated width rule: halves of 128
    "alibi_untied_qknorm_parallel": dict(
        pos_emb="alibi", no_weight_tying=True, use_qk_layernorm=True, gpt_j_residual=True, sliding_window_width=3
    ),
    "sequence_parallel_gqa": dict(sequence_parallel=True, num_kv_heads=2, pos_emb="rotary", activation="geglu",
                                  intermediate_size=384),
    "value_head_sequence_parallel": dict(value_head=True, sequence_parallel=True, pos_emb="sinusoidal"),
    "rpe_local_gqa": dict(
        pos_emb="rpe", attention_config=[[["local", "global"], 1]], sliding_window_width=2, num_kv_heads=2
    ),
    # Qwen2's block: biases on the fused QKV's column-split sections only, none on the row-parallel output
    "qkv_bias_only_sequence_parallel": dict(use_bias_in_attn_linear=False, use_bias_in_qkv=True, use_bias_in_mlp=False,
                                            num_kv_heads=2, pos_emb="rotary", norm="rmsnorm", activation="swiglu",
                                            intermediate_size=384, sequence_parallel=True),
    # heads of kv_channels=12 channels, not hidden / heads = 8 (Qwen3's block: per-head q/k RMSNorm, GQA)
    "head_dim_qknorm_sequence_parallel": dict(kv_channels=12, num_kv_heads=2, use_qk_layernorm=True, pos_emb="rotary",
                                              norm="rmsnorm", activation="swiglu", intermediate_size=384,
                                              use_bias_in_attn_linear=False, sequence_parallel=True),
    # OLMo 2's block: norms after the sublayers only; RMSNorm over each whole q/k projection, its gains split with
    # the heads and its sum of squares reduced over the tp ranks
    "post_norm_qk_projection_sequence_parallel": dict(norm_placement="post", use_qk_layernorm=True,
                                                      qk_norm_scope="projection", num_kv_heads=2, pos_emb="rotary",
                                                      norm="rmsnorm", sequence_parallel=True),
    "sandwich_norm": dict(norm_placement="sandwich", norm="rmsnorm", num_kv_heads=2),  # Gemma 2/3's block
    # Gemma 2/3's pieces at once: (1 + w) norms around each sublayer, tanh GeGLU, scaled embeddings, 12-wide heads,
    # per-head q/k norms, query scalar, capped scores (on each rank's heads) and capped logits (on each rank's
    # vocabulary shard, the tied head on the last stage), local/global layers with their own rotary bases
    "gemma_sequence_parallel": dict(norm="gemma_rmsnorm", norm_placement="sandwich", activation="geglu_tanh",
                                    intermediate_size=384, kv_channels=12, num_kv_heads=2, use_qk_layernorm=True,
                                    pos_emb="rotary", query_pre_attn_scalar=10.0, attn_logit_softcapping=0.5,
                                    final_logit_softcapping=1.5, scale_embeddings_by_sqrt_hidden=True,
                                    attention_config=[[["local", "global"], 1]], sliding_window_width=3,
                                    rope_local_base_freq=100, use_bias_in_attn_linear=False, use_bias_in_mlp=False,
                                    sequence_parallel=True),
    # Mixtral / Qwen3-MoE: every MLP 4 SwiGLU experts (2 whole experts per tp rank), top-2 softmax routing
    # renormalised, 12-wide heads with per-head q/k RMSNorm
    "moe_topk_renormalised_sequence_parallel": dict(moe_num_experts=4, moe_top_k=2, moe_router_type="topk",
                                                    moe_router_renormalize=True, intermediate_size=16, kv_channels=12,
                                                    num_kv_heads=2, use_qk_layernorm=True, pos_emb="rotary",
                                                    norm="rmsnorm", activation="swiglu", use_bias_in_attn_linear=False,
                                                    use_bias_in_mlp=False, sequence_parallel=True),
}
PIPELINE_CONFIGS = ["mha_learned", "alibi_untied_qknorm_parallel", "value_head_sequence_parallel", "rpe_local_gqa",
                    "qkv_bias_only_sequence_parallel", "head_dim_qknorm_sequence_parallel",
                    "post_norm_qk_projection_sequence_parallel", "gemma_sequence_parallel",
                    "moe_topk_renormalised_sequence_parallel"]
# DeepSpeed optimizer paths (where the reduced gradient lives at the step): param.grad, ZeRO-2's flat
# partition fragments, the bf16 optimizer's fp32 buffer
ENGINE_PATHS: dict[str, dict[str, Any]] = {
    "fp32_zero0": dict(stage=0, bf16=False),
    "fp32_zero2": dict(stage=2, bf16=False),
    "bf16_zero1": dict(stage=1, bf16=True),
}
ENGINE_CONFIG = "sequence_parallel_gqa"


def _batch(cfg) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, cfg.padded_vocab_size, (2, cfg.seq_length), generator=gen)
    labels = torch.randint(0, cfg.padded_vocab_size, (2, cfg.seq_length), generator=gen)
    labels[0, 0] = -100
    loss_mask = torch.ones(2, cfg.seq_length)
    loss_mask[1, -1] = 0
    return tokens, labels, loss_mask


def _perturb(model: torch.nn.Module, cfg, full_shapes: dict[str, torch.Size]) -> None:
    """Add noise drawn for the FULL tensor (seeded by name) and keep this rank's shard of it."""
    from megatron.model import tp_partition_of
    from megatron.mpu import (
        get_tensor_model_parallel_rank,
        get_tensor_model_parallel_world_size,
    )
    from megatron.mpu.initialize_weights import shard_tensor

    rank, world = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
    with torch.no_grad():
        for name, p in model.named_parameters():
            gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            noise = 0.2 * torch.randn(full_shapes[name], generator=gen)
            part = tp_partition_of(cfg, name)
            if part is not None:
                noise = shard_tensor(noise, part.dim, rank, world, part.sections)
            p.add_(noise)


def _unshard(cfg, name: str, t: torch.Tensor) -> torch.Tensor:
    """The full tensor from every tp rank's shard (replicated ones: check they agree)."""
    from megatron.model import tp_partition_of
    from megatron.mpu import get_tensor_model_parallel_group
    from megatron.mpu.initialize_weights import unshard_tensors

    parts = [torch.empty_like(t) for _ in range(WORLD)]
    dist.all_gather(parts, t.contiguous(), group=get_tensor_model_parallel_group())
    part = tp_partition_of(cfg, name)
    if part is None:
        torch.testing.assert_close(parts[0], parts[1], msg=lambda m: f"replicated {name} differs across ranks: {m}")
        return parts[0]
    return unshard_tensors(parts, part.dim, part.sections)


def _loss(cfg, out: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    from megatron.model import lm_loss

    if cfg.value_head:  # [b, s, 1], replicated: any smooth function of all values
        return (out.squeeze(-1) * loss_mask).pow(2).mean()
    return lm_loss(out, labels, loss_mask)


def _run_tp1(cfg) -> dict[str, Any]:
    from megatron.model import GPTModel

    model = GPTModel(cfg)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    shapes = {n: p.shape for n, p in model.named_parameters()}
    _perturb(model, cfg, shapes)
    tokens, labels, loss_mask = _batch(cfg)
    logits = model(tokens)
    loss = _loss(cfg, logits, labels, loss_mask)
    loss.backward()
    return dict(
        init=init,
        shapes=shapes,
        logits=logits.detach(),
        loss=loss.detach(),
        grads={n: p.grad.clone() for n, p in model.named_parameters()},
        params={n: p.detach().clone() for n, p in model.named_parameters()},
    )


def check_tp2_equals_tp1(cfg, ref: dict[str, Any]) -> None:
    from deepspeed.runtime.utils import is_model_parallel_parameter

    from megatron import mpu
    from megatron.model import GPTModel
    from megatron.mpu.layers import partial_over_tensor_parallel, sum_partial_grads_over_tensor_parallel

    model = GPTModel(cfg)
    for name, value in model.state_dict().items():
        full = _unshard(cfg, name, value)
        assert torch.equal(full, ref["init"][name]), f"initial {name} differs from tp=1"
    _perturb(model, cfg, ref["shapes"])
    tokens, labels, loss_mask = _batch(cfg)
    logits = model(tokens)
    if cfg.value_head:
        full_logits = logits  # replicated
    else:
        assert logits.shape[-1] == cfg.padded_vocab_size // WORLD
        full_logits = torch.cat(_gathered(logits), dim=-1)
    torch.testing.assert_close(full_logits, ref["logits"], atol=1e-5, rtol=1e-5)
    loss = _loss(cfg, logits, labels, loss_mask)
    torch.testing.assert_close(loss, ref["loss"], atol=1e-6, rtol=1e-6)
    loss.backward()
    # norms under sequence parallelism and qk-norms over split heads: partial until the trainer's tp sum
    partial = partial_over_tensor_parallel(model)
    assert bool(partial) == bool(cfg.sequence_parallel or cfg.use_qk_layernorm)
    sum_partial_grads_over_tensor_parallel([p.grad for p in partial])
    for name, p in model.named_parameters():
        assert p.grad is not None, f"{name} got no gradient"
        full_grad = _unshard(cfg, name, p.grad)
        torch.testing.assert_close(
            full_grad, ref["grads"][name], atol=1e-5, rtol=1e-4, msg=lambda m: f"grad {name}: {m}"
        )
    if not cfg.sequence_parallel:  # incremental decoding at tp=2 reproduces the full tp=1 logits
        from megatron.model import KVCache

        cache = KVCache()
        with torch.no_grad():
            steps = [model(tokens[:, :3], kv_cache=cache)]
            steps += [model(tokens[:, i : i + 1], kv_cache=cache) for i in range(3, cfg.seq_length)]
        decoded = torch.cat(steps, dim=1)
        full_decoded = decoded if cfg.value_head else torch.cat(_gathered(decoded), dim=-1)
        torch.testing.assert_close(full_decoded, ref["logits"], atol=1e-5, rtol=1e-5)
    # DeepSpeed's grad-norm rule (tp-replicated params counted on tp rank 0 only) gives the tp=1 norm
    local = sum(
        p.grad.pow(2).sum()
        for p in model.parameters()
        if mpu.get_model_parallel_rank() == 0 or is_model_parallel_parameter(p)
    )
    total = torch.stack(_gathered(local.reshape(1))).sum().sqrt()
    want = torch.stack([g.pow(2).sum() for g in ref["grads"].values()]).sum().sqrt()
    torch.testing.assert_close(total, want, atol=1e-5, rtol=1e-5)


def _gathered(t: torch.Tensor) -> list[torch.Tensor]:
    from megatron.mpu import get_tensor_model_parallel_group

    parts = [torch.empty_like(t) for _ in range(WORLD)]
    dist.all_gather(parts, t.contiguous(), group=get_tensor_model_parallel_group())
    return parts


def check_pp2_equals_tp1(cfg, ref: dict[str, Any]) -> None:
    """Two PipelineModule stages, activation passed by hand: same weights, loss and grads as tp=1."""
    from deepspeed.pipe import PipelineModule

    from megatron import mpu
    from megatron.model import lm_loss, pipeline_layer_specs
    from megatron.model.pipeline import model_parameter_name

    def loss_fn(logits: torch.Tensor, target: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        labels, loss_mask = target  # the (labels, loss_mask) label part of a pipeline batch
        return lm_loss(logits, labels, loss_mask)

    stage = mpu.get_pipe_parallel_rank()
    pipe = PipelineModule(
        layers=pipeline_layer_specs(cfg),
        topology=mpu.get_topology(),
        loss_fn=loss_fn,
        partition_method="type:TransformerLayerPipe",
    )

    canonical = model_parameter_name  # PipelineModule's names -> GPTModel's

    names = dict(pipe.named_parameters())
    for name, p in names.items():
        assert torch.equal(p.detach(), ref["init"][canonical(name)]), f"stage {stage}: initial {name}"
        with torch.no_grad():
            p.copy_(ref["params"][canonical(name)])  # the same perturbed weights as the tp=1 run
    tokens, labels, loss_mask = _batch(cfg)
    hidden_shape = (cfg.seq_length, tokens.shape[0], cfg.hidden_size)
    if stage == 0:
        out = pipe(tokens)
        dist.send(out.detach().contiguous(), dst=1)
        grad = torch.empty(hidden_shape)
        dist.recv(grad, src=1)
        out.backward(grad)
    else:
        hidden = torch.empty(hidden_shape)
        dist.recv(hidden, src=0)
        hidden.requires_grad_()
        logits = pipe(hidden)
        torch.testing.assert_close(logits, ref["logits"], atol=1e-5, rtol=1e-5)
        loss = _loss(cfg, logits, labels, loss_mask) if cfg.value_head else loss_fn(logits, (labels, loss_mask))
        torch.testing.assert_close(loss, ref["loss"], atol=1e-6, rtol=1e-6)
        loss.backward()
        dist.send(hidden.grad.contiguous(), dst=0)
    for name, p in names.items():
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        if name.startswith("tied_modules."):
            grad = grad.clone()
            dist.all_reduce(grad)  # what DeepSpeed's tied-weight all-reduce does
            if "position_embeddings" in name and stage == 1:
                continue  # the head's copy of the embedding module does not use positions
        elif p.grad is None:
            raise AssertionError(f"stage {stage}: {name} got no gradient")
        torch.testing.assert_close(grad, ref["grads"][canonical(name)], atol=1e-5, rtol=1e-4,
                                   msg=lambda m: f"stage {stage} grad {name}: {m}")


def check_engine_step_equals_tp1(cfg, ref: dict[str, Any], path: dict[str, Any]) -> None:
    """One engine step (SGD, lr 1, no clipping: the update is minus the gradient) of two one-row
    micro-batches (each row counts 7 tokens, so their mean is the tp=1 batch loss)."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    from megatron import mpu
    from megatron.model import GPTModel
    from megatron.mpu.layers import partial_over_tensor_parallel
    from megatron.neox_arguments.deepspeed_split import gpu_defaults
    from megatron.engine.build import install_partial_grad_sum

    model = GPTModel(cfg)
    _perturb(model, cfg, ref["shapes"])
    config: dict[str, Any] = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 1, "steps_per_print": 10**9,
                              "gradient_clipping": 0.0, "zero_optimization": {"stage": path["stage"]},
                              "zero_allow_untested_optimizer": True}
    if path["bf16"]:
        config["bf16"] = {"enabled": True}
    gpu_defaults(config)  # what deepy.py hands DeepSpeed: bf16 accumulated and reduced in fp32
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
                                      config=config, mpu=mpu)
    install_partial_grad_sum(engine)  # as build_engine does
    expected = type(engine.optimizer).__name__
    assert expected == {0: "DeepSpeedEngine", 2: "DeepSpeedZeroOptimizer", 1: "BF16_Optimizer"}.get(
        path["stage"], expected) or path["stage"] == 0, expected
    partial = partial_over_tensor_parallel(engine.module)
    assert partial, "sequence parallelism leaves the norms' gradients partial"
    before = {n: safe_get_full_fp32_param(p).clone() if path["bf16"] else p.detach().clone()
              for n, p in engine.module.named_parameters()}
    tp_group = mpu.get_tensor_model_parallel_group()
    reduces: dict[str, list[int]] = {"backward": [], "step": []}
    real = dist.all_reduce
    phase = [""]

    def counting(tensor: torch.Tensor, *args: Any, group: Any = None, **kwargs: Any) -> Any:
        if phase[0] and group is tp_group and tensor.numel() > 1:  # not DeepSpeed's scalar norms
            reduces[phase[0]].append(tensor.numel())
        return real(tensor, *args, group=group, **kwargs)

    tokens, labels, loss_mask = _batch(cfg)
    dist.all_reduce = counting  # type: ignore[assignment]
    try:
        for row in range(2):
            loss = _loss(cfg, engine(tokens[row : row + 1]), labels[row : row + 1], loss_mask[row : row + 1])
            phase[0] = "backward"
            engine.backward(loss)
            phase[0] = "step"
            engine.step()
            phase[0] = ""
    finally:
        dist.all_reduce = real  # type: ignore[assignment]
    assert reduces == {"backward": [], "step": [sum(p.numel() for p in partial)]}, reduces
    for name, p in engine.module.named_parameters():
        after = safe_get_full_fp32_param(p) if path["bf16"] else p.detach()
        moved = _unshard(cfg, name, before[name] - after)
        want = ref["grads"][name]
        if path["bf16"]:
            # a bf16 forward and backward: the gradient to bf16's precision (3.5% off here at worst); a
            # partial gradient summed once too few or too many times would be 50-100% off
            assert (moved - want).norm() <= 0.1 * want.norm() + 1e-4, (name, float((moved - want).norm()),
                                                                       float(want.norm()))
        else:
            torch.testing.assert_close(moved, want, atol=1e-5, rtol=1e-4, msg=lambda m: f"step of {name}: {m}")


def check_old_bf16_zero1_checkpoint_loads() -> None:
    """Before issue 33 Deepy handed DeepSpeed no ``data_types``, so bf16 ZeRO-1 ran DeepSpeed's ZeRO-1
    optimizer (bf16 gradient accumulation); now ``grad_accum_dtype: fp32`` makes it run the bf16
    optimizer. A checkpoint of the old one (dp=2, two parameter groups, sizes that need padding) loads
    into the new one with every fp32 master weight, Adam moment and step count as saved."""
    import tempfile

    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    from megatron import mpu
    from megatron.deepspeed_internals import relink_optimizer_state_views
    from megatron.neox_arguments.deepspeed_split import gpu_defaults

    def engine(old: bool):  # type: ignore[no-untyped-def]
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(7, 11), torch.nn.LayerNorm(11), torch.nn.Linear(11, 5))
        matrices = [p for p in model.parameters() if p.dim() > 1]
        rest = [p for p in model.parameters() if p.dim() == 1]
        optimizer = torch.optim.AdamW([{"params": matrices}, {"params": rest, "weight_decay": 0.0}], lr=1e-2)
        config: dict[str, Any] = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
                                  "zero_optimization": {"stage": 1}, "zero_allow_untested_optimizer": True,
                                  "steps_per_print": 10**9}
        gpu_defaults(config)
        if old:
            del config["data_types"]  # what deepy.py wrote before issue 33
        eng, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config, mpu=mpu)
        return eng

    def state(eng):  # type: ignore[no-untyped-def]
        relink_optimizer_state_views(eng.optimizer)
        return {n: [safe_get_full_fp32_param(p)] + [safe_get_full_optimizer_state(p, k) for k in ("exp_avg", "exp_avg_sq")]
                for n, p in eng.module.named_parameters()}

    old = engine(old=True)
    assert type(old.optimizer).__name__ == "DeepSpeedZeroOptimizer"
    gen = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(4):
        old.backward(old(torch.randn(1, 7, generator=gen).bfloat16()).float().pow(2).mean())
        old.step()
    saved = state(old)
    directory = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(directory)
    old.save_checkpoint(directory[0], tag="old")
    new = engine(old=False)
    assert type(new.optimizer).__name__ == "BF16_Optimizer"
    new.load_checkpoint(directory[0], tag="old")
    loaded = state(new)
    for name, tensors in saved.items():
        for what, a, b in zip(("fp32 weight", "exp_avg", "exp_avg_sq"), tensors, loaded[name]):
            assert torch.equal(a, b), f"{name} {what} differs after loading"
    assert new.global_steps == old.global_steps == 2
    assert {float(s["step"]) for s in new.optimizer.optimizer.state.values()} == {2.0}


def _rank_main(rank: int, out_dir: str) -> None:
    faulthandler.enable()  # a native crash prints the Python stack
    torch.set_num_threads(1)
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(WORLD))  # PipelineModule reads them
    store = dist.FileStore(os.path.join(out_dir, "store"), WORLD)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD, timeout=timedelta(seconds=60))
    import deepspeed

    from megatron import mpu
    from gpt_configs import gpt_config

    from megatron.deepspeed_internals import defer_muon_kernel_compiles, skip_shared_memory_comm_op

    skip_shared_memory_comm_op()  # as train.py: no /dev/shm buffers left behind by DeepSpeed's op
    defer_muon_kernel_compiles()  # as train.py: ZeRO's Muon check without TorchInductor
    deepspeed.init_distributed(dist_backend="gloo")
    results: dict[str, str] = {}
    configs = {name: gpt_config(**{**BASE, **overrides}) for name, overrides in CONFIGS.items()}
    refs = {name: _run_tp1(cfg) for name, cfg in configs.items()}  # no model-parallel groups: tp=1

    def record(key: str, fn, *args) -> None:  # type: ignore[no-untyped-def]
        try:
            fn(*args)
            results[key] = "ok"
        except Exception:  # record and go on
            results[key] = traceback.format_exc()

    mpu.initialize_model_parallel(WORLD, 1)
    for name, cfg in configs.items():
        record(f"tp2_{name}", check_tp2_equals_tp1, cfg, refs[name])
    for path_name, path in ENGINE_PATHS.items():
        record(f"engine_{path_name}", check_engine_step_equals_tp1, configs[ENGINE_CONFIG], refs[ENGINE_CONFIG], path)
    mpu.destroy_model_parallel()
    mpu.initialize_model_parallel(1, WORLD)
    for name in PIPELINE_CONFIGS:
        record(f"pp2_{name}", check_pp2_equals_tp1, configs[name], refs[name])
    mpu.destroy_model_parallel()
    mpu.initialize_model_parallel(1, 1)  # dp=2
    record("old_bf16_zero1_checkpoint", check_old_bf16_zero1_checkpoint_loads)
    finish_rank(out_dir, rank, results)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, str]]:
    return run_ranks(_rank_main, WORLD, tmp_path_factory.mktemp("tp_model"))


@pytest.mark.parametrize("key", [f"tp2_{n}" for n in CONFIGS] + [f"pp2_{n}" for n in PIPELINE_CONFIGS])
def test_layouts_match_tp1(results: list[dict[str, str]], key: str) -> None:
    for rank, per_rank in enumerate(results):
        assert per_rank[key] == "ok", f"rank {rank}:\n{per_rank[key]}"


@pytest.mark.parametrize("path", list(ENGINE_PATHS))
def test_partial_gradients_are_summed_once_per_step_on_every_optimizer_path(results: list[dict[str, str]],
                                                                             path: str) -> None:
    for rank, per_rank in enumerate(results):
        assert per_rank[f"engine_{path}"] == "ok", f"rank {rank}:\n{per_rank[f'engine_{path}']}"


def test_a_bf16_zero1_checkpoint_from_before_issue_33_loads_into_the_bf16_optimizer(
        results: list[dict[str, str]]) -> None:
    for rank, per_rank in enumerate(results):
        assert per_rank["old_bf16_zero1_checkpoint"] == "ok", f"rank {rank}:\n{per_rank['old_bf16_zero1_checkpoint']}"
