"""Mamba, RWKV-6 and gMLP models, and blocks sharing parameters (``num_unique_layers``), at tp=2 and as pp=2
pipeline stages equal one rank, on 2 real gloo ranks.

For each family (tiny shapes, fp32) every rank first builds the one-rank model (no model-parallel
groups) and trains it three steps with AdamW from layout-independent perturbed weights, recording the
logits, loss and full gradients of step 1 and the loss of every step. Then the same config at tp=2:
initial full weights equal exactly, logits/loss/every full gradient equal, the three per-step losses
equal (<= 1e-5), and token-by-token decoding with the recurrent state in the KVCache reproduces the
logits. Then pp=2: two ``PipelineModule`` stages of ``pipeline_layer_specs`` (activation passed by hand)
give the same loss and gradients and the same three per-step losses. One spawn for everything.
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
STEPS = 3
LR = 3e-3
BASE = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=8, padded_vocab_size=64, seed=3)
FAMILIES: dict[str, dict[str, Any]] = {
    # projections with biases, so the row-parallel ones are summed once; untied head
    "mamba": dict(attention_config=[[["mamba"], 2]], norm="rmsnorm", mamba_use_bias_in_linears=True,
                  no_weight_tying=True),
    "mamba_sequence_parallel": dict(attention_config=[[["mamba"], 2]], sequence_parallel=True, pos_emb="none"),
    "rwkv": dict(attention_config=[[["rwkv"], 2]], hidden_size=64, num_attention_heads=2, norm="rmsnorm"),
    "gmlp_amlp": dict(attention_config=[[["gmlp", "amlp"], 1]], gmlp_attn_dim=8, pos_emb="none", no_weight_tying=True),
    # a hybrid stack: the families sit beside attention layers
    "hybrid": dict(num_layers=4, hidden_size=64, attention_config=[[["mamba", "global", "rwkv", "gmlp"], 1]],
                   pos_emb="rotary"),
    # num_unique_layers: 4 blocks from 2 parameter sets; grouped [1, 2, 1, 2] ties each set across the two pipeline
    # stages (DeepSpeed's tied-weight all-reduce sums its gradients), spread [1, 1, 2, 2] keeps each on one stage
    "shared_grouped": dict(num_layers=4, num_unique_layers=2, pos_emb="rotary"),
    "shared_spread": dict(num_layers=4, num_unique_layers=2, param_sharing_style="spread", pos_emb="rotary",
                          no_weight_tying=True),
}
PIPELINE = ["mamba", "rwkv", "gmlp_amlp", "hybrid", "shared_grouped", "shared_spread"]


def _batch(cfg) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, cfg.padded_vocab_size, (2, cfg.seq_length), generator=gen)
    labels = torch.randint(0, cfg.padded_vocab_size, (2, cfg.seq_length), generator=gen)
    loss_mask = torch.ones(2, cfg.seq_length)
    loss_mask[1, -1] = 0
    return tokens, labels, loss_mask


def _perturb(model: torch.nn.Module, cfg, full_shapes: dict[str, torch.Size], names=None) -> None:
    """Noise drawn for the FULL tensor (seeded by the GPTModel name), this rank's shard of it."""
    from megatron.model import tp_partition_of
    from megatron.mpu import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
    from megatron.mpu.initialize_weights import shard_tensor

    rank, world = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
    with torch.no_grad():
        for name, p in model.named_parameters():
            canonical = names(name) if names else name
            if not p.requires_grad:
                continue  # gMLP's never-added biases stay zero, as in GPT-NeoX
            gen = torch.Generator().manual_seed(zlib.crc32(canonical.encode()))
            noise = 0.1 * torch.randn(full_shapes[canonical], generator=gen)
            part = tp_partition_of(cfg, canonical)
            if part is not None:
                noise = shard_tensor(noise, part.dim, rank, world, part.sections)
            p.add_(noise)


def _gathered(t: torch.Tensor, group) -> list[torch.Tensor]:
    parts = [torch.empty_like(t) for _ in range(WORLD)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return parts


def _unshard(cfg, name: str, t: torch.Tensor) -> torch.Tensor:
    from megatron.model import tp_partition_of
    from megatron.mpu import get_tensor_model_parallel_group
    from megatron.mpu.initialize_weights import unshard_tensors

    parts = _gathered(t, get_tensor_model_parallel_group())
    part = tp_partition_of(cfg, name)
    if part is None:
        torch.testing.assert_close(parts[0], parts[1], msg=lambda m: f"replicated {name} differs across ranks: {m}")
        return parts[0]
    return unshard_tensors(parts, part.dim, part.sections)


def _loss(logits: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    from megatron.model import lm_loss

    return lm_loss(logits, labels, loss_mask)


def _optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    # elementwise, so a tensor-parallel shard steps exactly as its part of the full tensor does
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.01)


def _train_tp1(cfg) -> dict[str, Any]:
    from megatron.model import GPTModel

    model = GPTModel(cfg)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    shapes = {n: p.shape for n, p in model.named_parameters()}
    _perturb(model, cfg, shapes)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    tokens, labels, loss_mask = _batch(cfg)
    opt = _optimizer(model)
    losses, logits, grads = [], None, {}
    for step in range(STEPS):
        opt.zero_grad()
        out = model(tokens)
        loss = _loss(out, labels, loss_mask)
        loss.backward()
        if step == 0:
            logits = out.detach()
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        losses.append(loss.item())
    return dict(init=init, shapes=shapes, params=params, logits=logits, grads=grads, losses=losses)


def check_tp2(cfg, ref: dict[str, Any]) -> None:
    from megatron.model import GPTModel, KVCache
    from megatron.mpu import get_tensor_model_parallel_group
    from megatron.mpu.layers import partial_over_tensor_parallel, sum_partial_grads_over_tensor_parallel

    group = get_tensor_model_parallel_group()
    model = GPTModel(cfg)
    for name, value in model.state_dict().items():
        assert torch.equal(_unshard(cfg, name, value), ref["init"][name]), f"initial {name} differs from tp=1"
    _perturb(model, cfg, ref["shapes"])
    tokens, labels, loss_mask = _batch(cfg)
    opt = _optimizer(model)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        logits = model(tokens)
        loss = _loss(logits, labels, loss_mask)
        loss.backward()
        # replicated weights that see part of the data per tp rank: summed over tp, as the trainer does once per step
        sum_partial_grads_over_tensor_parallel([p.grad for p in partial_over_tensor_parallel(model)])
        if step == 0:
            torch.testing.assert_close(torch.cat(_gathered(logits, group), dim=-1), ref["logits"], atol=1e-5, rtol=1e-5)
            for name, p in model.named_parameters():
                if not p.requires_grad:
                    continue
                assert p.grad is not None, f"{name} got no gradient"
                torch.testing.assert_close(_unshard(cfg, name, p.grad), ref["grads"][name], atol=1e-5, rtol=1e-4,
                                           msg=lambda m: f"grad {name}: {m}")
        opt.step()
        losses.append(loss.item())
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref["losses"]), atol=1e-5, rtol=0)
    if not cfg.sequence_parallel:  # decoding with the recurrent state reproduces the full logits of the trained model
        full = model.eval()(tokens)
        cache = KVCache()
        with torch.no_grad():
            steps = [model(tokens[:, :3], kv_cache=cache)]
            steps += [model(tokens[:, i:i + 1], kv_cache=cache) for i in range(3, cfg.seq_length)]
        torch.testing.assert_close(torch.cat(steps, dim=1), full.detach(), atol=1e-5, rtol=1e-5)


def check_pp2(cfg, ref: dict[str, Any]) -> None:
    """Two PipelineModule stages, activation passed by hand: the tp=1 loss, gradients and per-step losses."""
    from deepspeed.pipe import PipelineModule

    from megatron import mpu
    from megatron.model.pipeline import BLOCK_PARTITION, model_parameter_name, pipeline_layer_specs

    stage = mpu.get_pipe_parallel_rank()
    pipe = PipelineModule(layers=pipeline_layer_specs(cfg), topology=mpu.get_topology(),
                          loss_fn=lambda logits, target: _loss(logits, *target), partition_method=BLOCK_PARTITION)
    names = dict(pipe.named_parameters())
    for name, p in names.items():
        assert torch.equal(p.detach(), ref["init"][model_parameter_name(name)]), f"stage {stage}: initial {name}"
        with torch.no_grad():
            p.copy_(ref["params"][model_parameter_name(name)])
    tokens, labels, loss_mask = _batch(cfg)
    shape = (cfg.seq_length, tokens.shape[0], cfg.hidden_size)
    opt = _optimizer(pipe)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        if stage == 0:
            out = pipe(tokens)
            dist.send(out.detach().contiguous(), dst=1)
            grad = torch.empty(shape)
            dist.recv(grad, src=1)
            out.backward(grad)
            loss = torch.empty(())
        else:
            hidden = torch.empty(shape)
            dist.recv(hidden, src=0)
            hidden.requires_grad_()
            loss = _loss(pipe(hidden), labels, loss_mask)
            loss.backward()
            dist.send(hidden.grad.contiguous(), dst=0)
        if cfg.num_unique_layers is not None:  # DeepSpeed's own all-reduce of the tied weights the specs name
            pipe.allreduce_tied_weight_gradients()
        for name, p in names.items():  # what DeepSpeed's tied-weight all-reduce does
            if name.startswith("tied_modules.") and p.requires_grad and cfg.num_unique_layers is None:
                grad = p.grad if p.grad is not None else torch.zeros_like(p)
                dist.all_reduce(grad)
                p.grad = grad
        if step == 0:
            for name, p in names.items():
                if not p.requires_grad or (name.startswith("tied_modules.") and "position" in name and stage == 1):
                    continue
                assert p.grad is not None, f"stage {stage}: {name} got no gradient"
                torch.testing.assert_close(p.grad, ref["grads"][model_parameter_name(name)], atol=1e-5, rtol=1e-4,
                                           msg=lambda m: f"stage {stage} grad {name}: {m}")
        opt.step()
        loss = loss.detach().clone()
        dist.broadcast(loss, src=1)  # the last stage's loss, for both ranks' records
        losses.append(loss.item())
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref["losses"]), atol=1e-5, rtol=0)


def _rank_main(rank: int, out_dir: str) -> None:
    faulthandler.enable()
    torch.set_num_threads(1)
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(WORLD))  # PipelineModule reads them
    store = dist.FileStore(os.path.join(out_dir, "store"), WORLD)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD, timeout=timedelta(seconds=120))
    import deepspeed

    from gpt_configs import gpt_config

    from megatron import mpu
    from megatron.deepspeed_internals import skip_shared_memory_comm_op

    skip_shared_memory_comm_op()
    deepspeed.init_distributed(dist_backend="gloo")
    configs = {name: gpt_config(**{**BASE, **keys}) for name, keys in FAMILIES.items()}
    refs = {name: _train_tp1(cfg) for name, cfg in configs.items()}
    results: dict[str, str] = {}

    def record(key: str, fn, *args) -> None:  # type: ignore[no-untyped-def]
        try:
            fn(*args)
            results[key] = "ok"
        except Exception:
            results[key] = traceback.format_exc()

    mpu.initialize_model_parallel(WORLD, 1)
    for name, cfg in configs.items():
        record(f"tp2_{name}", check_tp2, cfg, refs[name])
    mpu.destroy_model_parallel()
    mpu.initialize_model_parallel(1, WORLD)
    for name in PIPELINE:
        record(f"pp2_{name}", check_pp2, configs[name], refs[name])
    finish_rank(out_dir, rank, results)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, str]]:
    return run_ranks(_rank_main, WORLD, tmp_path_factory.mktemp("families"))


@pytest.mark.parametrize("key", [f"tp2_{n}" for n in FAMILIES] + [f"pp2_{n}" for n in PIPELINE])
def test_layouts_match_one_rank(results: list[dict[str, str]], key: str) -> None:
    for rank, per_rank in enumerate(results):
        assert per_rank[key] == "ok", f"rank {rank}:\n{per_rank[key]}"
