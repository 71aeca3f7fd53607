"""Every DeepSpeed block Deepy accepts does something under each engine it can run in, read from
DeepSpeed's own state after ``deepspeed.initialize`` (not from the config dict we hand it).

One spawned gloo rank builds the real engine through ``build_engine`` twice, plain (``pipe_parallel_size:
0``, ``DeepSpeedEngine``) and as a ``PipelineModule`` (``pipe_parallel_size: 1``, ``PipelineEngine``), with
the blocks on, and records what DeepSpeed made of each block. Where a block cannot
take effect (the flops profiler on a pipeline) the rules refuse it before launch: the last test.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any

import pytest
from rank_harness import finish_rank, record_checks, run_ranks

MODEL: dict[str, Any] = {
    "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32,
    "max_position_embeddings": 32, "pos_emb": "rotary", "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
    "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 0.5,
    "train_iters": 4, "use_dummy_dataset": True,
    "tokenizer_type": "CharLevelTokenizer", "num_gpus": 1, "steps_per_print": 777,
    "checkpoint_activations": True,
    "wall_clock_breakdown": True,
    "dump_state": True,
    "comms_logger": {"enabled": True, "verbose": False, "prof_all": True},
    "zero_optimization": {"stage": 1, "overlap_comm": True},
    # GPT-NeoX's flat ZeRO keys, merged into the block
    "zero_reduce_scatter": False, "zero_contiguous_gradients": False, "zero_reduce_bucket_size": 12345,
    "zero_allgather_bucket_size": 23456,
    "fp32_allreduce": True, "prescale_gradients": True, "gradient_predivide_factor": 2.0,
    "data_types": {"grad_accum_dtype": "fp32"},
    "checkpoint": {"use_node_local_storage": True},
    # DeepSpeed's own monitors (the engine builds them; both engines write their events)
    "csv_monitor": {"enabled": True, "job_name": "blocks"}, "tensorboard": {"enabled": True, "job_name": "blocks"},
    "wandb": {"enabled": True, "project": "blocks"},
}  # fmt: skip
CHECKPOINT_OPTIONS = {"partition_activations": True, "contiguous_checkpointing": True, "checkpoint_in_cpu": True,
                      "synchronize_each_layer": True, "profile_backward": True}
ENGINES = {
    # the DeepSpeed block spelling of the activation-checkpointing options, and the flops profiler
    "plain": {"pipe_parallel_size": 0, "flops_profiler": {"enabled": True, "profile_step": 1},
              "activation_checkpointing": {"partition_activations": True, "contiguous_memory_optimization": True,
                                           "cpu_checkpointing": True, "synchronize_checkpoint_boundary": True,
                                           "profile": True, "number_checkpoints": 3}},
    # GPT-NeoX's flat spelling, bf16
    "pipe": {"pipe_parallel_size": 1, **CHECKPOINT_OPTIONS, "precision": "bfloat16",
             # the stage through GPT-NeoX's flat key instead of the block
             "zero_optimization": {"overlap_comm": True}, "zero_stage": 1},
}


def _engine_state(overrides: dict[str, Any], out_dir: str) -> dict[str, Any]:
    import deepspeed.comm as ds_comm
    from deepspeed.runtime.activation_checkpointing import checkpointing as ds_ckpt

    from megatron.initialize import initialize
    from megatron.neox_arguments import finalize
    from megatron.neox_arguments.arguments import NeoXArgs
    from megatron.neox_arguments.resolved import ResolvedConfig
    from megatron.config_rules import Device
    from megatron.neox_arguments.run_config import RunConfig
    from megatron.engine.build import build_engine

    import logging

    from deepspeed.utils import logger as ds_logger

    from megatron.logging.log import set_deepspeed_log_level

    set_deepspeed_log_level("warning")  # Deepy's default deepspeed_log_level
    dumped: list[str] = []
    capture = logging.Handler()
    capture.emit = lambda record: dumped.append(record.getMessage())  # type: ignore[method-assign]
    ds_logger.addHandler(capture)
    for monitor in ("csv_monitor", "tensorboard"):  # DeepSpeed's own monitors write under the test's directory
        overrides = {**overrides, monitor: {**MODEL[monitor], "output_path": str(Path(out_dir, monitor))}}
    resolved = finalize(ResolvedConfig(args=NeoXArgs(**{**MODEL, **overrides})), 1,
                        device=Device(cuda=False, fp16_supported=False))
    run = RunConfig.from_resolved(resolved)
    initialize(run.parallel, run.training.seed)
    eng = build_engine(run, run.model.with_vocab(128), 4)
    ds_logger.removeHandler(capture)
    engine = eng.engine
    state = {
        "engine": type(engine).__name__,
        "checkpointing": [ds_ckpt.PARTITION_ACTIVATIONS, ds_ckpt.CONTIGUOUS_CHECKPOINTING, ds_ckpt.CPU_CHECKPOINT,
                          ds_ckpt.SYNCHRONIZE, ds_ckpt.PROFILE_TIME],
        "number_checkpoints": ds_ckpt.num_layers,
        "steps_per_print": engine.steps_per_print(),
        "communication_data_type": str(engine.communication_data_type),
        "postscale_gradients": engine.postscale_gradients(),
        "gradient_predivide_factor": engine.gradient_predivide_factor(),
        "reduce_scatter": engine.zero_reduce_scatter(),
        "grad_accum_dtype": str(engine.get_data_types()[1]),
        "use_node_local_storage": engine.use_node_local_storage(),
        "csv_monitor": engine.monitor.csv_monitor is not None and engine.monitor.enabled,
        "tensorboard": engine.monitor.tb_monitor is not None and engine.monitor.enabled,
        "wandb": engine.monitor.wandb_monitor is not None and engine.monitor.enabled,
        "bf16": engine.bfloat16_enabled(),
        "gradient_accumulation_steps": engine.gradient_accumulation_steps(),
        "gradient_clipping": engine.gradient_clipping(),
        "wall_clock_breakdown": engine.wall_clock_breakdown(),
        "comms_logger": bool(ds_comm.comms_logger.enabled and ds_comm.comms_logger.prof_all),
        "stage": engine.zero_optimization_stage(),
        "reduce_bucket_size": engine.zero_reduce_bucket_size(),
        "allgather_bucket_size": engine.zero_allgather_bucket_size(),
        "contiguous_gradients": engine.zero_contiguous_gradients(),
        "overlap_comm": engine.zero_overlap_comm(),
        "flops_profiler": engine.flops_profiler_enabled(),
        "flops_profiler_object": getattr(engine, "flops_profiler", None) is not None,
        # dump_state: DeepSpeed's own print of its engine state reached its logger at the default level
        "dump_state": any(line.startswith("DeepSpeedEngine:") for line in dumped)
                      and any("zero_optimization_stage" in line for line in dumped),
    }
    return state


BF16_EVERYWHERE = {
    "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32, "max_position_embeddings": 32,
    "pos_emb": "rotary", "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}, "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 1, "train_iters": 4, "use_dummy_dataset": True, "warmup": 0.0,
    "tokenizer_type": "CharLevelTokenizer", "num_gpus": 1, "sharding_strategy": "fsdp", "precision": "bfloat16",
    # what the Levanter dialect writes for trainer.mp: bfloat16 (levanter_trainer.BF16_EVERYWHERE)
    "bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True},
}  # fmt: skip


def _bf16_everywhere_state() -> dict[str, Any]:
    """Levanter's ``mp: bfloat16`` under its default mesh (ZeRO-3): the dtypes DeepSpeed holds the weights,
    the optimizer's weights and Adam's moments in, and the losses of 4 steps on one batch."""
    import torch

    from megatron.config_rules import Device
    from megatron.initialize import initialize
    from megatron.neox_arguments import finalize
    from megatron.neox_arguments.arguments import NeoXArgs
    from megatron.neox_arguments.resolved import ResolvedConfig
    from megatron.neox_arguments.run_config import RunConfig
    from megatron.engine.build import build_engine
    from megatron.training.step import train_step

    resolved = finalize(ResolvedConfig(args=NeoXArgs(**BF16_EVERYWHERE)), 1, device=Device(cuda=False, fp16_supported=False))
    run = RunConfig.from_resolved(resolved)
    initialize(run.parallel, run.training.seed)
    eng = build_engine(run, run.model.with_vocab(128), 4)
    engine = eng.engine
    batch = {"text": torch.randint(0, 128, (4, 33), generator=torch.Generator().manual_seed(0))}
    losses = [float(train_step(eng, iter([batch]), torch.device("cpu")).loss) for _ in range(4)]
    states = engine.optimizer.optimizer.state.values()
    return {
        "stage": engine.zero_optimization_stage(),
        "weights": sorted({str(getattr(p, "ds_tensor", p).dtype) for p in engine.module.parameters()}),
        # ZeRO-3's own copy of the weights the optimizer updates (named fp32, held in the master dtype)
        "optimizer_weights": sorted({str(t.dtype) for t in engine.optimizer.fp32_partitioned_groups_flat}),
        "moments": sorted({f"{k}:{v.dtype}" for st in states for k, v in st.items() if torch.is_tensor(v) and v.dim()}),
        "losses": losses,
    }


def rank_main(rank: int, out_dir: str) -> None:
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    os.environ["MASTER_PORT"] = Path(out_dir, "port").read_text()
    # DeepSpeed's own W&B monitor: offline, under the test's directory
    os.environ.update(WANDB_MODE="offline", WANDB_SILENT="true", WANDB_DIR=out_dir)
    results: dict[str, str] = {}

    def record(name: str, overrides: dict[str, Any]) -> None:
        results[name] = json.dumps(_engine_state(overrides, out_dir))

    checks = {name: (lambda n=name, o=over: record(n, o)) for name, over in ENGINES.items()}
    checks["bf16_everywhere"] = lambda: results.__setitem__("bf16_everywhere", json.dumps(_bf16_everywhere_state()))
    errors = record_checks(checks)
    finish_rank(out_dir, rank, {**{f"error:{k}": v for k, v in errors.items() if v != "ok"}, **results})


@pytest.fixture(scope="module")
def states(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    out = tmp_path_factory.mktemp("ds_blocks")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        (out / "port").write_text(str(sock.getsockname()[1]))
    (result,) = run_ranks(rank_main, 1, out, timeout_s=300)
    errors = {k: v for k, v in result.items() if k.startswith("error:")}
    assert not errors, errors
    return {k: json.loads(v) for k, v in result.items()}


@pytest.mark.parametrize("engine", list(ENGINES))
def test_blocks_reach_deepspeeds_state(engine: str, states: dict[str, dict[str, Any]]) -> None:
    got = states[engine]
    assert got["engine"] == {"plain": "DeepSpeedEngine", "pipe": "PipelineEngine"}[engine]
    assert got["checkpointing"] == [True] * 5
    assert got["number_checkpoints"] == (3 if engine == "plain" else 2)  # the block's, else num_layers
    assert got["wall_clock_breakdown"] is True
    assert got["dump_state"] is True
    assert got["comms_logger"] is True
    assert got["steps_per_print"] == 777
    assert (got["stage"], got["reduce_bucket_size"], got["allgather_bucket_size"], got["reduce_scatter"],
            got["contiguous_gradients"], got["overlap_comm"]) == (1, 12345, 23456, False, False, True)
    assert got["communication_data_type"] == "torch.float32"  # fp32_allreduce
    assert (got["postscale_gradients"], got["gradient_predivide_factor"]) == (False, 2.0)
    assert got["grad_accum_dtype"] == "torch.float32" and got["use_node_local_storage"] is True
    assert got["csv_monitor"] is got["tensorboard"] is got["wandb"] is True
    assert got["bf16"] is (engine == "pipe")
    assert (got["gradient_accumulation_steps"], got["gradient_clipping"]) == (2, 0.5)
    if engine == "plain":
        assert got["flops_profiler"] and got["flops_profiler_object"]


def test_one_dtype_bf16_keeps_weights_and_adam_moments_in_bf16(states: dict[str, dict[str, Any]]) -> None:
    """Levanter's ``mp: bfloat16`` (jmp: params, compute, output bf16; optax adam's moments in the params'
    dtype): under ZeRO-3 DeepSpeed holds no fp32 copy - weights, the optimizer's weights and Adam's
    exp_avg/exp_avg_sq are bf16 - and 4 steps on one batch train it (the loss falls)."""
    got = states["bf16_everywhere"]
    assert got["stage"] == 3
    assert got["weights"] == got["optimizer_weights"] == ["torch.bfloat16"]
    assert got["moments"] == ["exp_avg:torch.bfloat16", "exp_avg_sq:torch.bfloat16"]
    losses = got["losses"]
    assert all(b < a for a, b in zip(losses, losses[1:])), losses


def test_flops_profiler_is_refused_on_a_pipeline() -> None:
    from megatron.errors import ConfigError
    from megatron.neox_arguments import finalize
    from megatron.neox_arguments.arguments import NeoXArgs
    from megatron.neox_arguments.resolved import ResolvedConfig
    from megatron.config_rules import Device

    args = NeoXArgs(**{**MODEL, "pipe_parallel_size": 1, "flops_profiler": {"enabled": True}})
    with pytest.raises(ConfigError, match="flops_profiler.enabled .* pipeline engine never prints"):
        finalize(ResolvedConfig(args=args), 1, device=Device(cuda=False, fp16_supported=False))


def test_checkpoint_options_without_checkpointing_are_refused_or_said() -> None:
    """The DeepSpeed block with nothing checkpointed is refused; GPT-NeoX's flat options (which its own
    configs set with checkpointing off) are listed as ignored, with why, in what deepy.py prints."""
    from megatron.errors import ConfigError
    from megatron.neox_arguments import finalize
    from megatron.neox_arguments.arguments import NeoXArgs
    from megatron.neox_arguments.resolved import ResolvedConfig
    from megatron.config_rules import Device

    cpu = Device(cuda=False, fp16_supported=False)
    base = {**MODEL, "checkpoint_activations": False, "activation_checkpointing": None}
    with pytest.raises(ConfigError, match="activation_checkpointing .*changes nothing"):
        finalize(ResolvedConfig(args=NeoXArgs(**{**base, "activation_checkpointing": {"profile": True}})), 1,
                 device=cpu)
    with pytest.raises(ConfigError, match="activation_checkpointing.partition_activation .*is not a DeepSpeed"):
        finalize(ResolvedConfig(args=NeoXArgs(**{**MODEL, "activation_checkpointing": {"partition_activation": 1}})),
                 1, device=cpu)
    said = finalize(ResolvedConfig(args=NeoXArgs(**{**base, "synchronize_each_layer": True})), 1, device=cpu)
    assert any("ignored: synchronize_each_layer=True" in w and "no activations are checkpointed" in w
               for w in said.warnings), said.warnings
