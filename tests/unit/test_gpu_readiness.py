"""What would break or be slow on NVIDIA GPUs, shown on the CPU: each test names the mechanism
(issue 33) and fails on the code before the fix."""

from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist


class _Stop(Exception):
    """Raised by a stand-in collective once it has seen its tensor."""


def _pretend_nccl(monkeypatch: pytest.MonkeyPatch, device: str = "meta") -> None:
    """torch.distributed says NCCL and DeepSpeed's accelerator names ``device`` as the current GPU."""
    import deepspeed.accelerator

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    fake = types.SimpleNamespace(current_device_name=lambda: device)
    monkeypatch.setattr(deepspeed.accelerator, "get_accelerator", lambda: fake)


# --- collectives: the tensor lives where the backend moves memory -----------------------------------
def test_tensor_parallel_statistics_are_reduced_on_the_collective_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """log_param_norm & co. with tp > 1 all-reduce a table over the tensor-parallel group: under NCCL
    it must be a GPU tensor (a CPU float64 tensor is refused at the first log step)."""
    from megatron.logging.stats import StatsCollector
    from megatron.mpu import topology

    _pretend_nccl(monkeypatch)
    monkeypatch.setattr(topology, "get_tensor_model_parallel_world_size", lambda: 2)
    monkeypatch.setattr(topology, "get_tensor_model_parallel_rank", lambda: 0)
    monkeypatch.setattr(topology, "get_tensor_model_parallel_group", lambda: None)
    seen: list[torch.device] = []

    def all_reduce(tensor: torch.Tensor, group: object = None) -> None:
        seen.append(tensor.device)
        raise _Stop

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    collector = StatsCollector.__new__(StatsCollector)
    collector.named = [("w", torch.nn.Parameter(torch.ones(2)))]
    with pytest.raises(_Stop):
        collector._reduce({"w": [1.0, 0.0, 2.0]})
    assert seen == [torch.device("meta")]


# --- which GPUs a rank gets -------------------------------------------------------------------------
def _local_launch(**keys: object) -> object:
    from megatron.neox_arguments.arguments import NeoXArgs

    return NeoXArgs(**keys)


@pytest.mark.parametrize("num_gpus, slots", [(None, [4, 5]), (1, [4])])
def test_a_local_launch_keeps_the_visible_devices(num_gpus: int | None, slots: list[int]) -> None:
    """With CUDA_VISIBLE_DEVICES=4,5 (two GPUs to torch) the ranks run on GPUs 4 and 5, not 0 and 1:
    the per-node launcher writes the slots into each rank's CUDA_VISIBLE_DEVICES."""
    from megatron.launcher import local_ranks
    from megatron.launcher.resources import active_resources

    environ = {"CUDA_VISIBLE_DEVICES": "4,5"}
    active = active_resources(_local_launch(num_gpus=num_gpus), environ, lambda: 2)
    assert active == {"localhost": slots}
    envs = [local_ranks.rank_environment(environ, slots, r, "127.0.0.1", 29500) for r in range(len(slots))]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == [",".join(map(str, slots))] * len(slots)
    assert [e["LOCAL_RANK"] for e in envs] == [str(r) for r in range(len(slots))]


def test_devices_named_by_uuid_are_handed_on_by_name() -> None:
    from megatron.launcher import local_ranks

    environ = {"CUDA_VISIBLE_DEVICES": "GPU-aaaa,GPU-bbbb"}
    env = local_ranks.rank_environment(environ, [0, 1], 1, "127.0.0.1", 29500)
    assert env["CUDA_VISIBLE_DEVICES"] == "GPU-aaaa,GPU-bbbb"


@pytest.mark.parametrize("visible, local_id, expected", [("3", "3", "0"), ("2,3", "3", "1"), ("0,1,2,3", "3", "3"),
                                                         ("", "3", "3")])
def test_a_slurm_task_bound_to_its_own_gpu_is_local_rank_zero(visible: str, local_id: str, expected: str) -> None:
    """srun --gpus-per-task=1 shows task 3 of a node one GPU; DeepSpeed's engine calls
    set_device(LOCAL_RANK), so LOCAL_RANK must index what the task sees."""
    from megatron.launcher.environment import distributed_env

    env = {"SLURM_PROCID": "11", "SLURM_LOCALID": local_id, "SLURM_NTASKS": "16", "MASTER_ADDR": "10.0.0.1",
           "CUDA_VISIBLE_DEVICES": visible}
    assert distributed_env(env, prefer_slurm=True)["LOCAL_RANK"] == expected


# --- dropout streams: each pipeline stage and context-parallel piece draws its own masks -----------
def _masks_at(monkeypatch: pytest.MonkeyPatch, tp: int, pp: int, cp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first dropout mask of the default stream and of the tensor-parallel stream on a rank at (tp, pp, cp)."""
    from megatron.mpu import random as mpu_random

    for name, value in (("get_tensor_model_parallel_rank", tp), ("get_pipe_parallel_rank", pp),
                        ("get_context_parallel_rank", cp)):
        monkeypatch.setattr(mpu_random, name, lambda value=value: value, raising=False)
    mpu_random.model_parallel_manual_seed(1234)
    replicated = torch.rand(64) < 0.5
    with mpu_random.tensor_parallel_rng():
        sharded = torch.rand(64) < 0.5
    return replicated, sharded


def test_each_stage_and_context_piece_draws_its_own_dropout_masks(monkeypatch: pytest.MonkeyPatch) -> None:
    state = torch.get_rng_state()
    try:
        first = _masks_at(monkeypatch, 0, 0, 0)
        assert all(torch.equal(a, b) for a, b in zip(first, _masks_at(monkeypatch, 0, 0, 0)))  # reproducible
        for coords in ((0, 1, 0), (0, 0, 1), (0, 1, 1)):  # another stage, context piece, or both
            other = _masks_at(monkeypatch, *coords)
            assert not torch.equal(first[0], other[0]) and not torch.equal(first[1], other[1]), coords
        # tensor-parallel ranks of one stage agree on replicated activations, differ on their shards
        tp1 = _masks_at(monkeypatch, 1, 0, 0)
        assert torch.equal(first[0], tp1[0]) and not torch.equal(first[1], tp1[1])
    finally:
        from megatron.mpu.random import get_rng_tracker

        get_rng_tracker().reset()  # no seeded tracker left behind for other tests of this process
        torch.set_rng_state(state)


def test_stream_seeds_of_a_grid_are_all_different() -> None:
    from megatron.mpu.random import stream_seeds

    grid = [stream_seeds(7, tp, pp, cp) for tp in range(8) for pp in range(16) for cp in range(8)]
    default = {(pp, cp): stream_seeds(7, 0, pp, cp)[0] for pp in range(16) for cp in range(8)}
    assert len(set(default.values())) == len(default)
    assert len({s for _, s in grid}) == len(grid) and not {s for _, s in grid} & set(default.values())
    assert stream_seeds(7, 0) == (7, 7 + 2718)  # one stage, no context parallelism: as before


# --- attention: which SDPA call each variant makes ----------------------------------------------------
ATTN = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=16, max_position_embeddings=16,
            padded_vocab_size=64, seed=3)


def _sdpa_calls(monkeypatch: pytest.MonkeyPatch, **keys: object) -> list[dict[str, object]]:
    """What one forward of a 2-layer model hands SDPA (mask or none, kv heads, grouped-query flag)."""
    import torch.nn.functional as F

    from megatron.model import GPTConfig, GPTModel
    from megatron.model import attention

    calls: list[dict[str, object]] = []
    real = F.scaled_dot_product_attention

    def spy(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: object) -> torch.Tensor:
        calls.append({"mask": kw.get("attn_mask") is not None, "kv_heads": k.shape[1],
                      "enable_gqa": kw.get("enable_gqa", False), "scale": kw.get("scale")})
        return real(q, k, v, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", spy)
    model = GPTModel(GPTConfig(**{**ATTN, **keys}))
    model(torch.randint(0, 64, (2, 16)))
    return calls


@pytest.mark.parametrize("width, masked", [(15, False), (64, False), (14, True), (4, True)])
def test_a_window_as_long_as_the_sequence_keeps_the_flash_path(monkeypatch: pytest.MonkeyPatch, width: int,
                                                                masked: bool) -> None:
    """seq 16: a query sees at most 15 earlier keys, so a window of 15 or more is plain causal attention
    (no mask: is_causal, which the flash kernel takes); 14 cuts something and needs its mask."""
    calls = _sdpa_calls(monkeypatch, sliding_window_width=width, pos_emb="rotary")
    assert [c["mask"] for c in calls] == [masked, masked]


@pytest.mark.parametrize("window", [None, 4])
def test_grouped_query_attention_with_a_mask_does_not_fall_back_to_the_math_kernel(
        monkeypatch: pytest.MonkeyPatch, window: int | None) -> None:
    """SDPA's enable_gqa exists in the flash and math kernels only, and flash takes no mask: with a
    mask (a Mistral window here) the kv heads are repeated for their queries so the memory-efficient
    kernel can take it; without one, the grouped call stays (flash)."""
    calls = _sdpa_calls(monkeypatch, num_kv_heads=2, pos_emb="rotary", sliding_window_width=window)
    if window is None:
        assert calls == [{"mask": False, "kv_heads": 2, "enable_gqa": True, "scale": None}] * 2
    else:
        assert calls == [{"mask": True, "kv_heads": 4, "enable_gqa": False, "scale": None}] * 2


def test_gqa_with_a_mask_computes_what_grouped_attention_does() -> None:
    """The repeated kv heads give the grouped result: query head i reads kv head i // (n / n_kv)."""
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, n, 8, 4, generator=gen) for n in (4, 2, 2))
    mask = torch.ones(8, 8, dtype=torch.bool).tril().triu(-3)
    grouped = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    from megatron.model import GPTConfig
    from megatron.model.attention import SelfAttention

    layer = SelfAttention(GPTConfig(**{**ATTN, "hidden_size": 16, "num_kv_heads": 2}), "l0")
    torch.testing.assert_close(layer._attend(q, k, v, mask, 0.0), grouped)


def test_the_inverse_layer_scale_compiles_one_graph_for_every_layer() -> None:
    """scale_attn_by_inverse_layer_idx as a float attribute made torch.compile specialise on it: one
    graph per layer (and layers past the recompile limit run uncompiled)."""
    from megatron.model import GPTConfig, GPTModel
    from megatron.torch_internals import compile_counts, reset_compile_counts
    from megatron.engine.build import transformer_layers

    reset_compile_counts()
    model = GPTModel(GPTConfig(**{**ATTN, "scale_attn_by_inverse_layer_idx": True}))
    for layer in transformer_layers(model):
        layer.forward = torch.compile(layer.forward, backend="eager")
    model(torch.randint(0, 64, (2, 16)))
    assert compile_counts() == (1, 0)
    reset_compile_counts()


def test_packed_documents_are_read_from_the_device_once_per_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    """Document masks read the spans with .tolist() (a host sync on a GPU): once per micro-batch, not
    once per layer and row."""
    from megatron.model import GPTConfig, GPTModel
    from megatron.model.documents import document_ids_from_eod

    model = GPTModel(GPTConfig(**{**ATTN, "num_layers": 4}))
    tokens = torch.randint(1, 64, (3, 16))
    tokens[:, 5] = tokens[0, 11] = 0  # end-of-document tokens: 2 or 3 documents per row
    documents = document_ids_from_eod(tokens, 0)
    reads = 0
    real = torch.Tensor.tolist

    def counting(self: torch.Tensor) -> object:
        nonlocal reads
        reads += 1
        return real(self)

    monkeypatch.setattr(torch.Tensor, "tolist", counting)
    model(tokens, document_ids=documents.clone())
    assert reads == 1


# --- the model is made where it trains --------------------------------------------------------------
def test_the_model_is_built_in_its_dtype_on_the_training_device() -> None:
    """build_engine builds the model on the rank's device (``training_device()``) in the run's dtype:
    the meta device stands in for a GPU here, so every parameter and buffer being on it shows that none
    was made on the host first (they were: the whole model in host memory, 14 GB per rank for 7B in
    bf16, before DeepSpeed moved it). Built on the CPU, the weights are the bits of before."""
    from megatron.model import GPTConfig, GPTModel
    from megatron.neox_arguments import NeoXArgs
    from megatron.neox_arguments.run_config import parallel_run
    from megatron.engine.activation_config import ActivationCheckpointArgs
    from megatron.engine.build import build_model, training_device
    from megatron.objectives import LMObjective, ObjectiveArgs

    keys = {**ATTN, "pos_emb": "rotary", "num_kv_heads": 2, "use_qk_layernorm": True}
    config = GPTConfig(**keys, precision="bfloat16")

    def built(device: torch.device | None, cfg: GPTConfig = config) -> torch.nn.Module:
        return build_model(cfg, parallel_run(NeoXArgs()), ActivationCheckpointArgs(), False, LMObjective(ObjectiveArgs()),
                           device=device)[0]

    on_device = built(torch.device("meta"))
    tensors = dict(on_device.named_parameters()) | dict(on_device.named_buffers())
    assert tensors and {t.device.type for t in tensors.values()} == {"meta"}
    assert {p.dtype for p in on_device.parameters()} == {torch.bfloat16}
    assert training_device() == torch.device("cpu")  # this machine's ranks train on the CPU
    fp32 = GPTConfig(**keys)
    before = GPTModel(fp32).state_dict()
    after = built(training_device(), fp32).state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)


# --- the DeepSpeed config: bf16 sums in fp32, no synchronising throughput timer ---------------------
def _deepspeed_settings(**keys: object) -> object:
    from deepspeed.runtime.config import DeepSpeedConfig

    from megatron.config_rules import Device
    from megatron.neox_arguments.arguments import NeoXArgs
    from megatron.neox_arguments.derived import finalize
    from megatron.neox_arguments.resolved import ResolvedConfig

    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=128, train_micro_batch_size_per_gpu=4,
                train_iters=10, use_dummy_dataset=True, tokenizer_type="CharLevelTokenizer",
                optimizer={"type": "Adam", "params": {"lr": 0.001}})
    resolved = finalize(ResolvedConfig(args=NeoXArgs(**{**base, **keys})), 1,
                        device=Device(cuda=False, fp16_supported=True))
    return DeepSpeedConfig(resolved.deepspeed_config)  # what DeepSpeed's engine reads


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_bf16_gradients_are_accumulated_and_reduced_in_fp32(stage: int) -> None:
    """DeepSpeed's defaults accumulate and all-reduce bf16 gradients in bf16. fp32 communication at
    every stage; fp32 accumulation under ZeRO (DeepSpeed refuses it for the plain engine without
    ZeRO, and the pipeline's bf16 optimizer accumulates in fp32 already)."""
    parsed = _deepspeed_settings(precision="bfloat16", zero_optimization={"stage": stage})
    assert parsed.communication_data_type == torch.float32
    assert parsed.grad_accum_dtype == ("fp32" if stage else None)


def test_the_users_dtypes_win_and_fp32_runs_are_left_alone() -> None:
    parsed = _deepspeed_settings(precision="bfloat16", zero_optimization={"stage": 1},
                                 communication_data_type="bf16", data_types={"grad_accum_dtype": "bf16"})
    assert parsed.communication_data_type == torch.bfloat16 and parsed.grad_accum_dtype == "bf16"
    fp32 = _deepspeed_settings(zero_optimization={"stage": 1})
    assert fp32.communication_data_type is None and fp32.grad_accum_dtype is None


def test_deepspeeds_throughput_timer_does_not_synchronise_every_micro_batch() -> None:
    assert not _deepspeed_settings().timers_config.enabled
    mine = _deepspeed_settings(deepspeed_extra_args={"timers": {"throughput": {"enabled": True}}})
    assert mine.timers_config.enabled


# --- the batch's way to the GPU: pinned where it is finally shaped, copied without a host wait -----
def test_micro_batches_reach_a_gpu_through_pinned_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sample was pinned, but the objective's slicing and masking made new (pageable) tensors, and
    their copy made the host wait for the GPU every micro-batch. Every tensor of the micro-batch the
    engine reads is pinned and copied with non_blocking."""
    from megatron.objectives import ObjectiveArgs, build_objective

    copies: list[tuple[bool, str, bool]] = []
    real_to = torch.Tensor.to

    def pin(self: torch.Tensor) -> torch.Tensor:
        out = self.clone()
        out.pinned_here = True  # type: ignore[attr-defined]
        return out

    def to(self: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        device = torch.device(args[0]) if args and isinstance(args[0], (str, torch.device)) else None
        if device is None or device.type != "cuda":
            return real_to(self, *args, **kwargs)  # type: ignore[arg-type]
        copies.append((getattr(self, "pinned_here", False), device.type, bool(kwargs.get("non_blocking"))))
        return self

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin)
    monkeypatch.setattr(torch.Tensor, "to", to)
    objective = build_objective(ObjectiveArgs(reset_attention_mask=True, reset_position_ids=True), eod_token=0)
    batch = objective.prepare({"text": torch.tensor([[5, 6, 0, 7, 8, 9, 0, 4, 3]])})
    batch.to(torch.device("cuda", 0))
    assert len(copies) == 4  # inputs, labels, positions, documents
    assert copies == [(True, "cuda", True)] * 4


# --- once-per-step agreements that made the host wait for the device ----------------------------------
def test_the_preemption_flag_is_read_one_step_late_without_waiting_for_the_device(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU, reading the all-reduced flag at once (.item()) makes the host wait for the whole step;
    the deferred read returns the previous step's agreed flag from a finished copy instead."""
    from megatron.checkpointing.preemption import AgreedFlag

    flag = AgreedFlag(deferred=True)
    monkeypatch.setattr(torch.Tensor, "item", lambda self: pytest.fail("a device read in the step"))
    assert [flag.exchange((v,))[0] for v in (0, 1, 0, 0)] == [0, 0, 1, 0]
    monkeypatch.undo()
    assert [AgreedFlag(deferred=False).exchange((v,))[0] for v in (0, 1)] == [0, 1]  # gloo: read at once


class _Collectives:
    """A 2-rank world on paper: records the collectives a rank issues, each rank's posted value is what
    the others post too (MAX of equal values)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, rank: int) -> None:
        self.calls: list[str] = []
        monkeypatch.setattr(dist, "is_initialized", lambda: True)
        monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
        monkeypatch.setattr(dist, "get_rank", lambda group=None: rank)
        monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
        monkeypatch.setattr(dist, "broadcast", lambda tensor, src, group=None: self.calls.append("broadcast"))
        monkeypatch.setattr(dist, "all_reduce", lambda tensor, op=None, group=None: self.calls.append("all_reduce"))


def _manager(policy: object, deferred: bool, tmp_path: object) -> object:
    from megatron.checkpointing.manager import CheckpointManager
    from megatron.checkpointing.preemption import AgreedFlag, PreemptionWatcher

    watcher = PreemptionWatcher()
    watcher._agreed = AgreedFlag(deferred=deferred)  # NCCL's one-step-late read, on the CPU
    manager = CheckpointManager(save=str(tmp_path), load=None, policy=policy, args_dict={}, preemption=watcher)
    manager.save = lambda engine, step, consumed, kind="step", extra=None: (  # type: ignore[method-assign]
        setattr(manager, "last_saved_step", step), policy.on_committed(), saved.append((step, kind)))
    saved: list[tuple[int, str]] = []
    manager.saved = saved  # type: ignore[attr-defined]
    return manager


@pytest.mark.parametrize("deferred", [False, True])
def test_clock_based_saves_ride_on_the_once_per_step_agreement(monkeypatch: pytest.MonkeyPatch, tmp_path: object,
                                                               deferred: bool) -> None:
    """A save_interval needs rank 0's clock: its word travels in the preemption flag's all-reduce, so a
    step costs one collective and (under NCCL) no device read, with or without a time-based save; the
    step rules need no word at all. Rank 0's clock: 100 s per step, interval 250 s, and a step save at
    9: time-based saves after steps 3 and 6; read a step late (as under NCCL) after 4 and 8, and not
    again after 5 (the 'due' rank 0 posted at step 4, before that step's save, is not served twice)."""
    from megatron.checkpointing.commit import RetentionPolicy

    ranks = _Collectives(monkeypatch, rank=0)
    now = [0.0]
    policy = RetentionPolicy(train_iters=10, extra_save_iters=[9], save_interval_s=250.0, clock=lambda: now[0])
    manager = _manager(policy, deferred, tmp_path)
    if deferred:
        monkeypatch.setattr(torch.Tensor, "item", lambda self: pytest.fail("a device read in the step"))
    for step in range(1, 11):
        now[0] = 100.0 * step
        ranks.calls.clear()
        manager.maybe_save(None, step, consumed_samples=step)
        assert ranks.calls == ["all_reduce"], (step, ranks.calls)
    times = [4, 8] if deferred else [3, 6]
    assert manager.saved == [(times[0], "temporary"), (times[1], "temporary"), (9, "step"), (10, "step")]


def test_other_ranks_follow_rank_zeros_clock(monkeypatch: pytest.MonkeyPatch, tmp_path: object) -> None:
    """Rank 1 posts nothing for the clock: what it saves is what the agreement says, whatever its own
    clock shows (here: it never moves)."""
    from megatron.checkpointing.commit import RetentionPolicy

    _Collectives(monkeypatch, rank=1)
    policy = RetentionPolicy(train_iters=10, save_interval_s=250.0, clock=lambda: 0.0)
    manager = _manager(policy, False, tmp_path)
    posted: list[tuple[int, ...]] = []
    monkeypatch.setattr(manager.preemption._agreed, "exchange",
                        lambda values, group=None: posted.append(tuple(values)) or (0, 3 if len(posted) == 3 else 0))
    for step in range(1, 6):
        manager.maybe_save(None, step, consumed_samples=step)
    assert posted == [(0, 0)] * 5 and manager.saved == [(3, "temporary")]


# --- shipped configs: what a GPU user wants ---------------------------------------------------------
def _shipped() -> list[str]:
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "configs"
    return sorted(p.relative_to(root).as_posix() for p in root.glob("**/*.yml") if p.name != "local_setup.yml")


@pytest.mark.parametrize("name", _shipped())
def test_shipped_configs_neither_sync_every_layer_nor_reduce_in_one_bucket(name: str) -> None:
    """synchronize_each_layer waits for the device after every block (GPT-NeoX's configs set it); a
    ZeRO gradient bucket larger than the model reduces everything after the backward, overlapping
    nothing."""
    from pathlib import Path

    from megatron.model import num_parameters
    from megatron.neox_arguments import load_config

    args = load_config([str(Path(__file__).resolve().parents[2] / "configs" / name)], []).args
    assert not args.synchronize_each_layer
    zero = args.zero_optimization or {}
    if int(zero.get("stage", 0) or 0) >= 1 and "reduce_bucket_size" in zero:
        params = num_parameters(args.with_vocab(50304))
        assert float(zero["reduce_bucket_size"]) < params / 2, (zero["reduce_bucket_size"], params)


# --- the node: cores per rank, GPUs the job forgot, the compiler torch.compile needs ----------------
def test_srun_hands_on_the_jobs_cores_per_task() -> None:
    """Since Slurm 22.05 a job step does not inherit --cpus-per-task: each rank would get one core."""
    from megatron.launcher.slurm import srun_argv

    args = _local_launch(launcher="slurm")
    pool = {"n1": [0, 1]}
    assert "--cpus-per-task=12" in srun_argv(args, pool, pool, ["train.py"], "12")
    assert not any(a.startswith("--cpus-per-task") for a in srun_argv(args, pool, pool, ["train.py"]))


def test_a_slurm_job_that_got_no_gpus_on_a_gpu_node_stops(tmp_path: object) -> None:
    from pathlib import Path

    from megatron.launcher.environment import hidden_gpus_problem

    gpus = Path(str(tmp_path)) / "gpus"
    gpus.mkdir()
    for bus in ("0000:17:00.0", "0000:65:00.0"):
        (gpus / bus).mkdir()
    job = {"SLURM_JOB_ID": "77", "SLURM_PROCID": "3"}
    problem = hidden_gpus_problem(job, 0, str(gpus))
    assert problem is not None and "2 NVIDIA GPU(s)" in problem and "--gpus-per-node" in problem
    assert hidden_gpus_problem(job, 2, str(gpus)) is None  # it got them
    assert hidden_gpus_problem({**job, "CUDA_VISIBLE_DEVICES": ""}, 0, str(gpus)) is None  # CPU on purpose
    assert hidden_gpus_problem({}, 0, str(gpus)) is None  # not a Slurm job
    assert hidden_gpus_problem(job, 0, str(gpus / "none")) is None  # a node without NVIDIA GPUs


def test_compile_layers_without_a_compiler_is_refused_before_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron.config_rules import Device
    from megatron.errors import ConfigError
    from megatron.neox_arguments.arguments import NeoXArgs
    from megatron.neox_arguments.derived import finalize
    from megatron.neox_arguments.resolved import ResolvedConfig
    from megatron.engine import compile_checks

    monkeypatch.setattr(compile_checks.shutil, "which", lambda name: None)
    keys = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, train_micro_batch_size_per_gpu=2,
                train_iters=4, use_dummy_dataset=True, tokenizer_type="CharLevelTokenizer", compile_layers=True,
                lr=1e-3)
    resolved = ResolvedConfig(args=NeoXArgs(**keys), provenance={"compile_layers": "run.yml:7"})
    with pytest.raises(ConfigError, match=r"compile_layers: true \(run.yml:7\) needs a compiler toolchain.*g\+\+"):
        finalize(resolved, 1, device=Device(cuda=False, fp16_supported=False))
    # on a GPU node: a C compiler for Triton and Python.h
    assert compile_checks.toolchain_problems(True, {}, lambda name: "/usr/bin/cc" if name == "gcc" else None,
                                             str(tmp := __import__("tempfile").mkdtemp())) == [
        f"no {tmp}/Python.h (the Python development headers Triton compiles against: python3-dev or your "
        f"distribution's equivalent)"]
    assert compile_checks.toolchain_problems(False, {"CXX": "icpx"}, lambda name: None)[0].startswith(
        "no C++ compiler for inductor's C++ kernels (CXX='icpx' not found)")


def test_sinkhorn_routing_reads_its_convergence_every_eighth_iteration(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each convergence test is a device read (a host sync per MoE layer and micro-batch on a GPU)."""
    from megatron.model.moe import SINKHORN_CHECK_EVERY, sinkhorn

    reads = 0
    real = torch.Tensor.__bool__

    def counting(self: torch.Tensor) -> bool:
        nonlocal reads
        reads += 1
        return real(self)

    logits = torch.randn(64, 8, generator=torch.Generator().manual_seed(0)) * 3
    monkeypatch.setattr(torch.Tensor, "__bool__", counting)
    plan = sinkhorn(logits, max_iters=64)
    monkeypatch.undo()
    assert SINKHORN_CHECK_EVERY == 8 and 1 <= reads <= 64 // 8
    torch.testing.assert_close(plan.sum(0), torch.full((8,), 1 / 8), atol=1e-3, rtol=0)  # still balanced


def test_the_span_cache_notices_new_and_rewritten_ids() -> None:
    from megatron.model.documents import document_spans

    ids = torch.tensor([[0, 0, 1, 1, 1, 2]])
    assert document_spans(ids) == [[(0, 2), (2, 5), (5, 6)]]
    assert document_spans(ids.detach()) == [[(0, 2), (2, 5), (5, 6)]]  # a detached view: the same ids
    ids[0, 1:] += 1  # rewritten in place
    assert document_spans(ids) == [[(0, 1), (1, 2), (2, 5), (5, 6)]]
    assert document_spans(torch.zeros(2, 3, dtype=torch.long)) == [[(0, 3)], [(0, 3)]]
