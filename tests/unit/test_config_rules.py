"""Rules and derived values of ``finalize``: each problem names the key, its value and file:line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from megatron.errors import ConfigError
from megatron.neox_arguments.arguments import NeoXArgs
from megatron.neox_arguments.derived import detect_world_size, finalize
from megatron.neox_arguments.resolved import ResolvedConfig
from megatron.config_rules import Device, RULES, RuleContext, check
from megatron.time_phrases import TimePhraseError, parse_duration

CPU = Device(cuda=False, fp16_supported=False)
GPU = Device(cuda=True, fp16_supported=True)

BASE: dict[str, Any] = {
    "num_layers": 4,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "seq_length": 128,
    "train_micro_batch_size_per_gpu": 4,
    "train_iters": 100,
    "lr": 1e-3,
    "use_dummy_dataset": True,
}


def resolved(drop: tuple[str, ...] = (), **values: Any) -> ResolvedConfig:
    """Args as if read from ``cfg.yml``, one key per line, in the order given."""
    merged = {**{k: v for k, v in BASE.items() if k not in drop}, **values}
    merged.setdefault("tokenizer_type", "CharLevelTokenizer")  # dummy data still needs a tokenizer
    provenance = {key: f"cfg.yml:{line}" for line, key in enumerate(merged, start=1)}
    return ResolvedConfig(args=NeoXArgs(**merged), provenance=provenance)


def line_of(config: ResolvedConfig, key: str) -> str:
    return config.provenance[key]


def problems(world: int = 1, device: Device = CPU, **values: Any) -> str:
    config = resolved(**values)
    with pytest.raises(ConfigError) as err:
        finalize(config, world, device=device)
    return err.value.message


def ok(world: int = 1, device: Device = CPU, drop: tuple[str, ...] = (), **values: Any) -> ResolvedConfig:
    return finalize(resolved(drop=drop, **values), world, device=device)


# --- the baseline and what finalize derives -----------------------------------------------------
def test_baseline_passes_and_derives_values_marked_derived() -> None:
    config = ok(world=2)
    args = config.args
    assert (args.train_batch_size, args.gradient_accumulation_steps, args.train_micro_batch_size_per_gpu) == (8, 1, 4)
    assert args.max_position_embeddings == 128
    assert args.precision == "fp32"
    assert args.world_size == 2 and args.global_num_gpus == 2
    for key in ("train_batch_size", "max_position_embeddings", "precision", "world_size"):
        assert config.provenance[key] == "derived"
    assert config.provenance["train_micro_batch_size_per_gpu"] == "cfg.yml:5"
    assert config.deepspeed_config["train_batch_size"] == 8


def test_every_rule_is_quiet_on_a_good_config() -> None:
    config = ok(world=4)
    ctx = RuleContext(config.args, config.provenance, world_size=4, device=CPU)
    assert len(RULES) >= 20
    for rule in RULES:
        assert rule(ctx) == [], rule.__name__


def test_all_problems_are_reported_at_once() -> None:
    message = problems(hidden_size=65, min_lr=0.1, lr=0.01, train_epochs=3)
    assert message.startswith("3 problems in the config")
    assert "hidden_size=65 (cfg.yml:2)" in message
    assert "min_lr=0.1" in message
    assert "train_epochs=3" in message


# --- batch arithmetic ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "given, world, expected",
    [
        ({"train_micro_batch_size_per_gpu": 4}, 2, (8, 4, 1)),
        ({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3}, 2, (12, 2, 3)),
        ({"train_micro_batch_size_per_gpu": 2, "train_batch_size": 16}, 2, (16, 2, 4)),
        ({"gradient_accumulation_steps": 2, "train_batch_size": 16}, 4, (16, 2, 2)),
        ({"train_batch_size": 12}, 3, (12, 4, 1)),
        ({"batch_size": 3}, 2, (6, 3, 1)),
        ({"per_device_parallelism": 5}, 2, (10, 5, 1)),
        ({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "train_batch_size": 8}, 2, (8, 2, 2)),
    ],
)
def test_batch_sizes_any_two_give_the_third(given: dict[str, int], world: int, expected: tuple[int, int, int]) -> None:
    config = ok(world=world, drop=("train_micro_batch_size_per_gpu",), **given)
    args = config.args
    assert (args.train_batch_size, args.train_micro_batch_size_per_gpu, args.gradient_accumulation_steps) == expected


def test_batch_dp_excludes_model_parallel_ranks() -> None:
    # 8 ranks, tp=2, pp=2 -> dp=2
    args = ok(world=8, model_parallel_size=2, pipe_parallel_size=2, train_micro_batch_size_per_gpu=3).args
    assert args.train_batch_size == 6


def test_inconsistent_batch_names_every_key_and_line() -> None:
    message = problems(world=2, gradient_accumulation_steps=2, train_batch_size=10)
    assert "train_batch_size=10 (cfg.yml:10)" in message
    assert "train_micro_batch_size_per_gpu=4 (cfg.yml:5)" in message
    assert "gradient_accumulation_steps=2 (cfg.yml:9)" in message
    assert "= 16" in message


def test_train_batch_not_a_multiple_of_micro_times_dp() -> None:
    message = problems(world=2, train_batch_size=12)
    assert "train_batch_size=12 (cfg.yml:9) is not a multiple of" in message and "8" in message


def test_micro_batch_aliases_must_agree() -> None:
    message = problems(batch_size=8)
    assert "train_micro_batch_size_per_gpu=4 (cfg.yml:5)" in message and "batch_size=8 (cfg.yml:9)" in message


def test_no_batch_size_at_all() -> None:
    config = resolved(drop=("train_micro_batch_size_per_gpu",))
    with pytest.raises(ConfigError, match="no batch size"):
        finalize(config, 1, device=CPU)


# --- layout and model shape -------------------------------------------------------------------
def test_world_must_split_into_tp_times_pp() -> None:
    message = problems(world=6, model_parallel_size=2, pipe_parallel_size=2)
    assert "world size 6 is not divisible" in message
    assert "model_parallel_size=2 (cfg.yml:9)" in message and "pipe_parallel_size=2 (cfg.yml:10)" in message


def test_pipe_parallel_zero_counts_as_one_stage() -> None:
    assert ok(world=2, pipe_parallel_size=0).args.train_batch_size == 8


@pytest.mark.parametrize(
    "values, world, needle",
    [
        ({"hidden_size": 66}, 1, "hidden_size=66 (cfg.yml:2) is not divisible by num_attention_heads=4 (cfg.yml:3)"),
        ({"num_attention_heads": 4, "model_parallel_size": 8, "hidden_size": 64}, 8, "num_attention_heads=4 (cfg.yml:3) is not divisible by model_parallel_size=8"),
        ({"num_kv_heads": 3}, 1, "num_kv_heads=3 (cfg.yml:9) does not divide num_attention_heads=4"),
        ({"num_attention_heads": 12, "hidden_size": 96, "num_kv_heads": 6, "model_parallel_size": 4}, 4, "num_kv_heads=6 (cfg.yml:9) is not divisible by model_parallel_size=4 (cfg.yml:10)"),
        ({"num_layers": 2, "pipe_parallel_size": 4}, 4, "num_layers=2 (cfg.yml:1) is fewer than pipe_parallel_size=4 (cfg.yml:9)"),
        ({"max_position_embeddings": 64}, 1, "seq_length=128 (cfg.yml:4) exceeds max_position_embeddings=64 (cfg.yml:9)"),
        ({"padded_vocab_size": 50000, "model_parallel_size": 2}, 2, "padded_vocab_size=50000 (cfg.yml:9) is not a multiple of"),
    ],
)
def test_model_shape_rules(values: dict[str, Any], world: int, needle: str) -> None:
    assert needle in problems(world=world, **values)


def test_kv_heads_split_whole_across_tensor_parallel_ranks() -> None:
    ok(world=2, num_attention_heads=8, num_kv_heads=2, model_parallel_size=2)
    # replicating a kv head over several ranks is not implemented by the attention layer
    assert "num_kv_heads=2" in problems(world=4, num_attention_heads=8, num_kv_heads=2, model_parallel_size=4)


def test_missing_model_shape() -> None:
    config = resolved(drop=("hidden_size",))
    with pytest.raises(ConfigError, match="hidden_size not set"):
        finalize(config, 1, device=CPU)


# --- precision ------------------------------------------------------------------------------------
def test_fp16_and_bf16_together() -> None:
    message = problems(device=GPU, fp16={"enabled": True}, bf16={"enabled": True})
    assert "both fp16 (cfg.yml:9) and bf16 (cfg.yml:10)" in message


def test_precision_contradicting_block() -> None:
    message = problems(device=GPU, precision="fp16", bf16={"enabled": True})
    assert "precision='fp16' (cfg.yml:9) contradicts bf16.enabled=true (cfg.yml:10)" in message


def test_precision_derived_from_block_and_block_from_precision() -> None:
    assert ok(bf16={"enabled": True}).args.precision == "bfloat16"
    config = ok(precision="bfloat16")
    assert config.args.bf16 == {"enabled": True} and config.provenance["bf16"] == "derived"
    assert config.deepspeed_config["bf16"] == {"enabled": True}


def test_fp16_needs_a_gpu_on_cpu_only_machines() -> None:
    assert "fp16 needs a GPU: use bf16 or fp32 on CPU" in problems(device=CPU, precision="fp16")
    assert ok(device=GPU, fp16={"enabled": True}).args.precision == "fp16"


def test_fp16_from_a_cpu_login_node_to_gpu_nodes_is_allowed(tmp_path: Path) -> None:
    # deepy.py on a head node without GPUs launching onto a hostfile's nodes: the head's device says nothing
    hostfile = tmp_path / "hosts"
    hostfile.write_text("gpu1 slots=2\n")
    assert ok(world=2, device=CPU, precision="fp16", hostfile=str(hostfile)).args.fp16 == {"enabled": True}


# --- ZeRO x parallelism ---------------------------------------------------------------------------
@pytest.mark.parametrize("pipe", [1, 2])
def test_zero2_with_pipeline_module_is_refused(pipe: int) -> None:
    message = problems(world=2, zero_optimization={"stage": 2}, pipe_parallel_size=pipe)
    assert "ZeRO stage 2 (zero_optimization.stage at cfg.yml:9)" in message
    assert f"pipe_parallel_size={pipe} (cfg.yml:10)" in message
    assert "pipe_parallel_size: 0" in message


def test_zero_shorthand_and_allowed_combinations() -> None:
    assert ok(world=2, zero_stage=2, pipe_parallel_size=0).args.zero_optimization == {"stage": 2}
    assert ok(world=2, zero_stage=1, pipe_parallel_size=2).deepspeed_config["zero_optimization"] == {"stage": 1}
    assert "ZeRO stage 3 (zero_stage at cfg.yml:9) with model_parallel_size=2" in problems(world=2, zero_stage=3, pipe_parallel_size=0, model_parallel_size=2)


def test_zero_shorthand_contradicting_block() -> None:
    message = problems(zero_stage=1, zero_optimization={"stage": 2})
    assert "zero_stage=1 (cfg.yml:9) contradicts zero_optimization.stage=2" in message


# --- learning rate, length, warmup --------------------------------------------------------------
def test_learning_rates() -> None:
    assert "lr=0.001 (cfg.yml:7) is below min_lr=0.01 (cfg.yml:9)" in problems(min_lr=0.01)
    config = resolved(drop=("lr",))
    with pytest.raises(ConfigError, match="no learning rate"):
        finalize(config, 1, device=CPU)
    ok(drop=("lr",), optimizer={"type": "Adam", "params": {"lr": 0.01}}, min_lr=0.001)
    assert "disagree" in problems(optimizer={"type": "Adam", "params": {"lr": 0.01}})


def test_train_iters_xor_epochs() -> None:
    assert "both train_iters=100 (cfg.yml:6) and train_epochs=2 (cfg.yml:9)" in problems(train_epochs=2)
    config = resolved(drop=("train_iters",))
    with pytest.raises(ConfigError, match="neither train_iters nor train_epochs"):
        finalize(config, 1, device=CPU)


def test_warmup_fraction_or_whole_steps() -> None:
    ok(warmup=0.0)
    ok(warmup=1.0)
    ok(warmup=50)
    assert "warmup=1.5 (cfg.yml:9)" in problems(warmup=1.5)
    assert "warmup=500.0 (cfg.yml:9) steps is more than train_iters=100" in problems(warmup=500)


# --- checkpoints ------------------------------------------------------------------------------------
def test_save_needs_a_schedule_and_vice_versa() -> None:
    assert "save='ckpt' (cfg.yml:9) but no save schedule" in problems(save="ckpt")
    assert "checkpoint_factor=10 (cfg.yml:9) but save" in problems(checkpoint_factor=10)
    ok(save="ckpt", checkpoint_factor=10)
    ok(save="ckpt", keep=[{"every": 100}])


def test_save_interval_phrase_becomes_seconds() -> None:
    config = ok(save="ckpt", save_interval="1h30m")
    # the user's value, respelled: it keeps the user's provenance (issue 32: a cli value showed "derived")
    assert config.args.save_interval == 5400 and config.provenance["save_interval"] == "cfg.yml:10"
    assert "save_interval='15 minutes later' (cfg.yml:10)" in problems(save="ckpt", save_interval="15 minutes later")


@pytest.mark.parametrize(
    "phrase, seconds",
    [("15min", 900), ("60s", 60), ("2h", 7200), ("1h30m", 5400), ("1d", 86400), ("90", 90), (45, 45), ("0.5h", 1800)],
)
def test_time_phrases(phrase: str | int, seconds: float) -> None:
    assert parse_duration(phrase) == seconds


@pytest.mark.parametrize("phrase", ["", "15", "15 mins later", "1h1h", "0s", "-5m", "h", "1.5.h", True])
def test_bad_time_phrases(phrase: Any) -> None:
    if phrase == "15":
        assert parse_duration(phrase) == 15  # a bare number is seconds
        return
    with pytest.raises(TimePhraseError):
        parse_duration(phrase)


# --- data -------------------------------------------------------------------------------------------
def make_dataset(prefix: Path) -> str:
    """A small real .bin/.idx pair: the file checks open what the config names."""
    import numpy as np

    from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder

    prefix.parent.mkdir(parents=True, exist_ok=True)
    builder = MMapIndexedDatasetBuilder(str(prefix) + ".bin", np.uint16)
    for i in range(4):
        builder.add_item(np.arange(5) + i)
        builder.end_document()
    builder.finalize(str(prefix) + ".idx")
    return str(prefix)


def test_data_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    message = problems(data_path="d/x", train_data_paths=["a"], valid_data_paths=["b"], test_data_paths=["c"])
    assert "data_path='d/x' (cfg.yml:9)" in message and "train_data_paths=['a'] (cfg.yml:10)" in message
    message = problems(use_dummy_dataset=False)
    assert "no training data" in message
    assert "train_urls=['u.jsonl'] (cfg.yml:9) needs cache_dir" in problems(train_urls=["u.jsonl"])
    # every file the config names is checked before launch, naming the key and where it was set
    assert "train_urls (cfg.yml:9): u.jsonl not found" in problems(use_dummy_dataset=False, train_urls=["u.jsonl"],
                                                                    cache_dir="cache")
    assert "data_path (cfg.yml:9): dataset d/x: d/x.bin and d/x.idx not found" in problems(
        use_dummy_dataset=False, data_path="d/x")
    (tmp_path / "u.jsonl").write_text('{"text": "hello"}\n')
    ok(use_dummy_dataset=False, train_urls=["u.jsonl"], cache_dir="cache")
    make_dataset(tmp_path / "d" / "x")
    ok(use_dummy_dataset=False, data_path="d/x", seq_length=4)  # its 20 tokens hold samples of 4 + 1


def test_weights_and_labels_match_paths() -> None:
    message = problems(train_data_paths=["a", "b"], train_data_weights=[1.0], train_label_data_paths=["la"])
    assert "train_data_weights has 1 entries (cfg.yml:10) but train_data_paths has 2 (cfg.yml:9)" in message
    assert "train_label_data_paths has 1 entries (cfg.yml:11) but train_data_paths has 2" in message


def test_launch_keys() -> None:
    assert "comment='x' (cfg.yml:9) only apply to srun" in problems(comment="x")
    ok(comment="x", launcher="slurm")
    assert "keep one" in problems(deepspeed_mpi=True, deepspeed_slurm=True)


def test_check_runs_a_single_rule_in_isolation() -> None:
    from megatron.model.checks import heads_divide_hidden

    config = resolved(hidden_size=66)
    ctx = RuleContext(config.args, config.provenance)
    assert len(check(ctx, [heads_divide_hidden])) == 1


# --- world size ----------------------------------------------------------------------------------
def _runner_args(**values: Any) -> NeoXArgs:
    return NeoXArgs(**values)


def test_world_size_from_num_gpus_without_cuda() -> None:
    assert detect_world_size(_runner_args(num_gpus=3), device_count=1) == 3
    assert detect_world_size(_runner_args(), device_count=1) == 1
    assert detect_world_size(_runner_args(), device_count=4) == 4


def test_world_size_from_hostfile_and_filters(tmp_path: Path) -> None:
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("worker-0 slots=4\nworker-1 slots=4\n# spare\nworker-2 slots=2\n")
    h = str(hostfile)
    assert detect_world_size(_runner_args(hostfile=h)) == 10
    assert detect_world_size(_runner_args(hostfile=h, num_nodes=2)) == 8
    assert detect_world_size(_runner_args(hostfile=h, num_nodes=2, num_gpus=1)) == 2
    assert detect_world_size(_runner_args(hostfile=h, include="worker-0:0,1@worker-2")) == 4
    assert detect_world_size(_runner_args(hostfile=h, exclude="worker-1")) == 6
    with pytest.raises(ConfigError, match="include='worker-9'"):
        detect_world_size(_runner_args(hostfile=h, include="worker-9"))
    with pytest.raises(ConfigError, match="remove one"):
        detect_world_size(_runner_args(hostfile=h, include="worker-0", num_gpus=2))
    # a hostfile that does not exist: DeepSpeed's local fallback, said as a warning...
    warnings: list[str] = []
    assert detect_world_size(_runner_args(hostfile=str(tmp_path / "nope"), num_gpus=2), warnings=warnings) == 2
    assert "does not exist: launching on this machine only" in warnings[0]
    # ...unless the launch needs hosts from it
    with pytest.raises(ConfigError, match="does not exist, and the launch needs hosts"):
        detect_world_size(_runner_args(hostfile=str(tmp_path / "nope"), num_nodes=2))
    with pytest.raises(ConfigError, match="no hostfile"):
        detect_world_size(_runner_args(num_nodes=2), device_count=1)


def test_data_types_against_precision() -> None:
    message = problems(bf16={"enabled": True}, data_types={"grad_accum_dtype": "fp32"})
    assert "data_types.grad_accum_dtype=fp32 (cfg.yml:10) differs from the training dtype bf16 without ZeRO" in message
    ok(bf16={"enabled": True}, data_types={"grad_accum_dtype": "fp32"}, zero_stage=1)
    ok(bf16={"enabled": True}, data_types={"grad_accum_dtype": "bfloat16"})
    assert "data_types.param_dtype=fp16 (cfg.yml:10)" in problems(bf16={"enabled": True}, data_types={"param_dtype": "fp16"})


def test_pairwise_data_counts_as_data_and_needs_both_halves(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    make_dataset(tmp_path / "p")
    make_dataset(tmp_path / "n")
    ok(use_dummy_dataset=False, train_impl="dpo", pos_train_data_paths=["p"], neg_train_data_paths=["n"])
    message = problems(use_dummy_dataset=False, pos_train_data_paths=["p"], neg_train_data_paths=["n"])
    assert "no training data" not in message  # pairs count as data, for dpo/rm only
    assert "pos_train_data_paths=['p'] (cfg.yml:10) without its pair" in problems(
        use_dummy_dataset=False, train_impl="dpo", pos_train_data_paths=["p"])


def test_num_gpus_pinned_only_for_cpu_local_runs() -> None:
    # on CPU the runner would otherwise count NUMA nodes; on GPU it must keep honouring CUDA_VISIBLE_DEVICES
    cpu = ok(world=1, device=CPU)
    assert cpu.args.num_gpus == 1 and cpu.provenance["num_gpus"] == "derived"
    assert ok(world=1, device=GPU).args.num_gpus is None


def test_every_module_that_registers_checks_is_listed() -> None:
    """A component's ``@rule`` checks run only if their module is imported before checking: every module
    under megatron/ that uses ``@rule`` must be in CHECK_MODULES, and the rules checked are exactly theirs."""
    import ast

    from megatron.neox_arguments.check_modules import CHECK_MODULES, ordered_rules

    root = Path(__file__).resolve().parents[2]
    using = set()
    for path in (root / "megatron").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef) and any(
                    isinstance(d, ast.Name) and d.id == "rule" for d in node.decorator_list):
                using.add(".".join(path.relative_to(root).with_suffix("").parts))
    listed = {module.__name__ for module in CHECK_MODULES}
    assert len(using) >= 10 and using == listed, f"missing: {sorted(using - listed)}, stale: {sorted(listed - using)}"
    assert {fn.__module__ for fn in ordered_rules()} == listed
    assert sorted(ordered_rules(), key=id) == sorted(RULES, key=id)


def test_rules_between_components_read_several_components_keys() -> None:
    """A rule left in neox_arguments/rules.py relates keys no single component owns: each reads keys of
    at least two config groups, or only the argument layer's own (a rule of one component's keys belongs beside
    that component)."""
    import ast
    import inspect

    from megatron.neox_arguments import rules
    from megatron.neox_arguments.arguments import NeoXArgs

    owner = {}
    for group in NeoXArgs.__mro__:
        for name in getattr(group, "__annotations__", {}):
            owner.setdefault(name, group.__module__)
    # ctx.tp/pp/cp/dp read the parallelism keys, zero_stage() the ZeRO keys, the world size and the device
    # the launch (num_gpus, launcher, ...)
    implied = {"tp": "model_parallel_size", "pp": "pipe_parallel_size", "cp": "context_parallel_size",
               "dp": "model_parallel_size", "zero_stage": "zero_optimization", "zero_source": "zero_optimization",
               "runs_on_this_machine": "launcher", "device": "launcher", "world_size": "num_gpus"}
    checked = 0
    for fn in (f for f in vars(rules).values() if inspect.isfunction(f) and f.__module__ == rules.__name__):
        if fn not in RULES:
            continue
        keys = set()
        for node in ast.walk(ast.parse(inspect.getsource(fn))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in owner:
                keys.add(node.value)
            name = getattr(node, "attr", None) or getattr(node, "id", None)
            if name in implied:
                keys.add(implied[name])
            table = vars(rules).get(name) if isinstance(node, ast.Name) else None
            if isinstance(table, (dict, tuple)):  # a module-level table of key names (_PRECISION_OF_BLOCK)
                keys.update(k for k in table if isinstance(k, str) and k in owner)
        groups = {owner[k] for k in keys if k in owner}
        # keys of the argument layer's own groups (DeepSpeed's blocks, precision) have no component to move to
        own = all(g.startswith("megatron.neox_arguments.") for g in groups)
        assert len(groups) >= 2 or own, f"{fn.__name__} reads only {sorted(keys)} ({groups}): move it beside that component"
        checked += 1
    assert checked >= 5


def test_the_model_guards_itself_with_the_same_checks() -> None:
    """A model built outside deepy.py (tools, conversions) is refused by the same check functions, not a
    second copy of the invariants: the explanation is the one deepy.py gives before launch."""
    from megatron.model.config import GPTConfig, ModelConfigError

    why = "each head gets hidden_size/num_attention_heads channels; pick a head count that divides 66"
    assert why in problems(hidden_size=66)
    with pytest.raises(ModelConfigError) as err:
        GPTConfig(num_layers=2, hidden_size=66, num_attention_heads=4, seq_length=32, moe_num_experts=2,
                  moe_top_k=3).check_architecture()
    assert why in err.value.message and "moe_top_k=3 exceeds moe_num_experts=2" in err.value.message
