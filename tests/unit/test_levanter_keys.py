"""Every key family Levanter's own configs use, written in Levanter's style, loads to what it means there.

The YAML below is written the way stanford-crfm/levanter's ``config/`` files write these keys (at
9263f81e: the mesh block of ``gpt2_nano.yaml``, the dumped ``llama2_7b.yaml``, ``llama3_small_4k_yarn.yaml``,
``gpt2_small_fast_eval.yaml``, ...), with local paths. Expected values are Levanter's code: the config
classes' defaults and ``TrainerConfig``/``CheckpointerConfig``/``AdamConfig`` as written in the comments.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from megatron.errors import ConfigError
from megatron.neox_arguments.dialects import split_argv
from megatron.neox_arguments.loading import load_config

MODEL = """\
model:
  type: gpt2
  hidden_dim: 32
  num_heads: 4
  num_layers: 2
"""


def load(tmp_path: Path, text: str, *flags: str) -> Any:
    (tmp_path / "tokenizer.json").write_text("{}")
    config = tmp_path / "run.yaml"
    config.write_text(text.format(root=tmp_path))
    _, parsed = split_argv(["--config_path", str(config), *flags])
    return load_config([], (), None, parsed)


def dry_run_lines(tmp_path: Path, text: str, capsys: pytest.CaptureFixture[str]) -> dict[str, str]:
    from megatron.app.deepy import dialect_table

    resolved = load(tmp_path, text)
    return {line.split()[0]: line for line in dialect_table(resolved) if line.startswith("  ")}


def test_levanters_defaults_from_its_code(tmp_path: Path) -> None:
    resolved = load(tmp_path, "trainer:\n  id: r1\n")
    a = resolved.args
    # TrainLmConfig.model = LlamaConfig(): 4096 / 11008 / 32 heads / 32 kv heads / 32 layers / 2048 tokens
    assert (a.hidden_size, a.ffn_hidden_size, a.num_attention_heads, a.num_kv_heads, a.num_layers,
            a.seq_length) == (4096, 11008, 32, 32, 32, 2048)
    assert a.checkpoint_activations  # gradient_checkpointing: True
    # CheckpointerConfig: checkpoints/ + run id, every 15 minutes, keep every 10000 steps; loads from there
    assert (a.save, a.load, a.save_interval, a.keep) == ("checkpoints/r1", "checkpoints/r1", "15min", [{"every": 10000}])
    # WandbConfig() is the default tracker (project levanter), its run id the trainer's
    tracker = a.tracker.model_dump()
    assert (tracker["type"], tracker["project"], tracker["id"]) == ("wandb", "levanter", "r1")
    # TrainerConfig: fsdp_axis embed shards parameters and optimizer states over the data axis
    assert (a.sharding_strategy, a.log_dir, a.cache_dir) == ("fsdp", "logs/", "cache/")
    # AdamConfig's default mask: no decay on embeddings (nor norms, biases)
    assert a.weight_decay_embeddings is False
    assert a.reset_attention_mask  # LmExample.causal: a token after eos starts a new segment
    assert "(implied)" in resolved.provenance["save_interval"]


def test_mesh_keys_at_levanters_values(tmp_path: Path) -> None:
    """gpt2_nano.yaml's mesh block (Levanter's defaults), written out: what Deepy's layout does."""
    text = MODEL + "trainer:\n  model_axis_size: 1\n  tensor_parallel_axes: [\"mlp\", \"heads\"]\n" \
                   "  fsdp_axis: \"embed\"\n  batch_axis: \"batch\"\n  axis_resources: {{}}\n" \
                   "  parameter_axis_resources: {{}}\n  replica_ici_axis_size: 1\n  replica_dcn_axis_size: 1\n"
    assert load(tmp_path, text).args.sharding_strategy == "fsdp"
    assert load(tmp_path, text, "--trainer.fsdp_axis", "null").args.sharding_strategy == "ddp"
    # gpt2_20b.yaml: batch over data, vocab/mlp/heads over model, "ZERO-3" embed over data
    zero3 = MODEL + "trainer:\n  fsdp_axis: null\n  model_axis_size: 2\n  axis_resources:\n    batch: \"data\"\n" \
                    "    vocab: \"model\"\n    mlp: \"model\"\n    heads: \"model\"\n" \
                    "  parameter_axis_resources:\n    embed: \"data\"\n"
    a = load(tmp_path, zero3.replace("  fsdp_axis: null\n", "")).args
    # beside tensor parallelism (no ZeRO-3 with tp here): gradients and optimizer states sharded, ZeRO-2
    assert (a.sharding_strategy, a.zero_stage, a.model_parallel_size) == (None, 2, 2)
    assert load(tmp_path, zero3.replace("  fsdp_axis: null\n", "").replace("model_axis_size: 2",
                                                                             "model_axis_size: 1")).args.sharding_strategy == "fsdp"
    for bad, reason in (("  tensor_parallel_axes: [\"position\", \"key_position\"]\n", "sequence splitting"),
                        ("  batch_axis: \"tokens\"\n", "batch axis is Levanter's 'batch'"),
                        ("  axis_resources:\n    heads: \"data\"\n", "heads: data is not a layout"),
                        ("  replica_dcn_axis_size: 2\n", "multi-slice replicas")):
        with pytest.raises(ConfigError, match=reason):
            load(tmp_path, MODEL + "trainer:\n" + bad)


@pytest.mark.parametrize(("policy", "precision"), [
    ("p=f32,c=bfloat16", "bfloat16"), ("compute=bfloat16,params=float32,output=bfloat16", "bfloat16"),
    ("f32", "fp32"), ("params=float32,compute=float16", "fp16")])
def test_mixed_precision_policy_strings(tmp_path: Path, policy: str, precision: str) -> None:
    assert load(tmp_path, MODEL + f"trainer:\n  mp: {policy}\n").args.precision == precision


def test_one_dtype_policy_keeps_weights_and_moments_in_bf16(tmp_path: Path) -> None:
    """gpt2_nano.yaml's ``mp: bfloat16``: jmp's one-dtype policy makes params, compute and output bf16,
    and optax's adam keeps its moments in the params' dtype; DeepSpeed's bf16 block says the same under
    ZeRO (Levanter's default fsdp_axis embed = ZeRO-3), which it allows only at stages 1-3."""
    args = load(tmp_path, MODEL + "trainer:\n  mp: bfloat16\n").args
    assert args.precision == "bfloat16" and args.sharding_strategy == "fsdp"  # ZeRO-3
    assert args.bf16 == {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
    tp = load(tmp_path, MODEL + "trainer:\n  mp: bfloat16\n  model_axis_size: 2\n").args
    assert tp.bf16["bf16_optimizer_states"] and tp.zero_stage == 2
    with pytest.raises(ConfigError, match=r"trainer.mp = 'bfloat16' .*need ZeRO 1-3.*fsdp_axis: null"):
        load(tmp_path, MODEL + "trainer:\n  mp: bfloat16\n  fsdp_axis: null\n")
    with pytest.raises(ConfigError, match=r"parameters in bfloat16 and computes in fp32"):
        load(tmp_path, MODEL + "trainer:\n  mp: p=bf16,c=f32\n")


def test_kernel_and_jax_keys_change_nothing_and_say_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = ("model:\n  type: llama\n  hidden_dim: 32\n  num_heads: 4\n  num_kv_heads: 4\n  num_layers: 2\n"
            "  flash_attention_block_size: 512\n  attn_backend: jax_flash\n  scan_layers: true\n"
            "  cross_entropy_block_size: 32000\n  gradient_checkpointing: nested\n  upcast_attn: false\n"
            "trainer:\n  jax_config:\n    jax_threefry_partitionable: true\n  log_jaxprs: false\n")
    lines = dry_run_lines(tmp_path, text, capsys)
    assert "nothing to set: a flash-attention kernel's block size" in lines["model.flash_attention_block_size"]
    assert "nothing to set: every backend computes exact attention" in lines["model.attn_backend"]
    assert "JAX's scan" in lines["model.scan_layers"] and "JAX runtime flags" in lines["trainer.jax_config"]
    assert "checkpoint_activations=true" in lines["model.gradient_checkpointing"]


def test_rope_choices(tmp_path: Path) -> None:
    llama = "model:\n  type: llama\n  hidden_dim: 32\n  num_heads: 4\n  num_kv_heads: 4\n  num_layers: 2\n  seq_len: 64\n"
    # llama3_small_4k_yarn.yaml's rope: yarn at factor 1 changes no frequency (Levanter's YarnRotaryEmbeddings)
    yarn = llama + ("  rope:\n    type: yarn\n    factor: 1.0\n    beta_fast: 32.0\n    beta_slow: 1.0\n"
                    "    original_max_position_embeddings: 256\n    mscale: 1.0\n")
    a = load(tmp_path, yarn).args
    assert (a.rotary_emb_base, a.rope_scaling) == (10000, None)
    # Llama3RotaryEmbeddingsConfig's defaults: theta 500000, factor 8, low 1, high 4, original 8192
    b = load(tmp_path, llama + "  rope:\n    type: llama3\n").args
    assert b.rotary_emb_base == 500000 and b.rope_scaling == {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}
    c = load(tmp_path, llama + "  rope:\n    type: default\n    theta: 10000\n    factor: 2.0\n").args
    assert c.rope_scaling == {"rope_type": "linear", "factor": 2.0}  # inv_freq / factor
    with pytest.raises(ConfigError, match="not Hugging Face's yarn"):
        load(tmp_path, yarn.replace("factor: 1.0", "factor: 4.0"))


def test_eval_harness_becomes_eval_tasks(tmp_path: Path) -> None:
    text = MODEL + "eval_harness:\n  task_spec: [\"piqa\", \"hellaswag\"]\neval_harness_steps: 1000\n"
    a = load(tmp_path, text).args
    assert (a.eval_tasks, a.eval_tasks_interval, a.eval_tasks_limit) == (["piqa", "hellaswag"], 1000, None)
    # gpt2_nano_harness.yaml: max_examples -> lm-eval's limit (eval_harness.py:609@9263f81e,
    # evaluator.evaluate(limit=config.max_examples)); eval_harness_steps is the harness hook's own
    # interval (train_lm.py:225-231), apart from steps_per_eval; without it 10000 (train_lm.py:68)
    b = load(tmp_path, text.replace("eval_harness_steps: 1000", "  max_examples: 32\neval_harness_steps: 50")).args
    assert (b.eval_tasks_limit, b.eval_tasks_interval, b.eval_interval) == (32, 50, 1000)
    assert load(tmp_path, text.replace("eval_harness_steps: 1000\n", "")).args.eval_tasks_interval == 10000
    with pytest.raises(ConfigError, match="max_eval_length is not built"):
        load(tmp_path, text.replace("eval_harness_steps", "  max_eval_length: 64\neval_harness_steps"))


def test_eval_batch_is_per_device_eval_parallelism(tmp_path: Path) -> None:
    """llama2_3b_pretrain.yaml: Levanter evaluates max_eval_batches x eval_batch_size examples
    (train_lm.py:179-181@9263f81e), eval_batch_size = per_device_eval_parallelism x data axis
    (trainer.py:808-810); -1 takes per_device_parallelism (trainer.py:954-961), -1 too: one train batch."""
    text = MODEL + "trainer:\n  train_batch_size: 64\n  per_device_parallelism: 2\n  max_eval_batches: 10\n"
    a = load(tmp_path, text + "  per_device_eval_parallelism: 8\n").args
    assert (a.train_micro_batch_size_per_gpu, a.eval_micro_batch_size_per_gpu, a.eval_iters) == (2, 8, 10)
    assert load(tmp_path, text).args.eval_micro_batch_size_per_gpu == 2  # not 2 x accumulation
    whole = load(tmp_path, MODEL + "trainer:\n  train_batch_size: 64\n  max_eval_batches: 10\n").args
    assert whole.eval_micro_batch_size_per_gpu is None  # the global batch, as Deepy's default


def test_epoch_caps_the_data_and_keeps_the_schedule(tmp_path: Path) -> None:
    """llama_7b_tulu.yaml's ``epoch: 3``: train_lm.py:144 wraps the train set in EpochDataset(max_epochs=3)
    (data/text.py:1018-1020@9263f81e) while num_train_steps still sets the schedule; 0 (the default,
    train_lm.py:66) repeats the data without end."""
    a = load(tmp_path, MODEL + "trainer:\n  num_train_steps: 500\nepoch: 3\n").args
    assert (a.max_train_epochs, a.train_iters, a.train_epochs) == (3, 500, None)
    assert load(tmp_path, MODEL + "epoch: 0\n").args.max_train_epochs is None


def test_the_epoch_cap_ends_the_run_at_its_last_whole_batch() -> None:
    """Where the run stops (tests/e2e/test_dialect_runs.py observes it): the schedule's 500 steps, or the
    whole global batches of max_train_epochs x the samples of one epoch; a remainder below one batch is
    not read (Levanter pads it with zero-loss examples, data/loader.py:322-335@9263f81e)."""
    from megatron.errors import ConfigError
    from megatron.training.config import last_iteration

    assert last_iteration(500, None, 8) == 500
    assert last_iteration(500, 3 * 51, 8) == 153 // 8 == 19
    assert last_iteration(10, 3 * 51, 8) == 10
    with pytest.raises(ConfigError, match="fewer than one global batch"):
        last_iteration(500, 7, 8)


@pytest.mark.parametrize(("text", "reason"), [
    ("trainer:\n  model_averaging:\n    type: ema_decay_sqrt\n", "model averaging 'ema_decay_sqrt'"),
    ("optimizer:\n  type: lion\n  skip_bad_steps: true\n", "only Levanter's adam optimizer has skip_bad_steps"),
    ("trainer:\n  quantization:\n    fp8: true\n", "quantised training \\(fp8"),
    ("optimizer:\n  type: sophia-g\n", "Sophia-G"),  # sophia-h is built (test_levanter_sophia.py)
    ("model:\n  type: gpt2_hyena\n", "Hyena"),
    ("model:\n  type: backpack\n", "Backpack"),
    ("model:\n  type: whisper\n", "speech"),
])
def test_features_not_built_are_refused_by_name(tmp_path: Path, text: str, reason: str) -> None:
    with pytest.raises(ConfigError, match=reason):
        load(tmp_path, text if text.startswith("model") else MODEL + text)


# stanford-crfm/levanter 9263f81e: optim/model_averaging.py EmaModelAveragingConfig (beta 0.999 by default);
# optim/skipstep.py SkipStepConfig (rolling_interval_length 128, sigma_factor 6.0; from_bool_int_or_config:
# true = defaults, an int = the window, false = off); only AdamConfig declares skip_bad_steps (optim/config.py).
@pytest.mark.parametrize(("text", "expected"), [
    ("trainer:\n  model_averaging:\n    type: ema\n    beta: 0.995\n", {"ema_beta": 0.995}),
    ("trainer:\n  model_averaging:\n    type: ema\n", {"ema_beta": 0.999}),
    ("trainer:\n  model_averaging: null\n", {"ema_beta": None}),
    ("optimizer:\n  skip_bad_steps: true\n", {"skip_bad_steps_window": 128, "skip_bad_steps_sigma": 6.0}),
    ("optimizer:\n  skip_bad_steps: 10\n", {"skip_bad_steps_window": 10, "skip_bad_steps_sigma": 6.0}),
    ("optimizer:\n  skip_bad_steps:\n    rolling_interval_length: 64\n    sigma_factor: 3.0\n",
     {"skip_bad_steps_window": 64, "skip_bad_steps_sigma": 3.0}),
    ("optimizer:\n  skip_bad_steps: false\n", {"skip_bad_steps_window": None}),
])
def test_ema_and_skip_bad_steps_map_to_their_keys(tmp_path: Path, text: str, expected: dict[str, Any]) -> None:
    args = load(tmp_path, MODEL + text).args
    assert {key: getattr(args, key) for key in expected} == expected


def test_skip_step_keys_refused_where_they_would_be_ignored(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="SkipStepConfig has no window"):
        load(tmp_path, MODEL + "optimizer:\n  skip_bad_steps:\n    window: 3\n")


DUMPED = """\
model:
  type: llama
  activation_function: silu
  attn_backend: null
  cross_entropy_block_size: null
  flash_attention_block_size: null
  hidden_dim: 64
  intermediate_dim: 128
  num_heads: 4
  num_kv_heads: 2
  num_layers: 2
  rope:
    factor: 1.0
    theta: 10000
    type: default
  seq_len: 32
  tie_word_embeddings: false
  upcast_attn: false
  use_bias: false
optimizer:
  cooldown: null
  cycle_length: null
  cycles: null
  decay: 0.1
  default_weight_decay_mask: null
  haps: null
  lr_schedule: inv
  type: adam
  warmup: 10
  weight_decay_modules: null
trainer:
  axis_resources: {{}}
  checkpointer:
    append_run_id_to_base_path: false
    base_path: {root}/ckpt
    keep:
    - every: 20000
    save_interval: 10m
  quantization: null
  id: dumped-0.001
  initialize_from: null
  load_checkpoint: null
  load_checkpoint_path: null
  max_eval_batches: null
  per_device_eval_parallelism: 2
  per_device_parallelism: 2
  ray:
    address: null
    auto_start_cluster: false
    start_workers: false
  require_accelerator: false
  tensor_parallel_axes: null
  tracker:
    entity: null
    group: null
    id: null
    mode: offline
    project: levanter
    resume: allow
    save_code: '{root}'
    save_xla_dumps: false
    tags: [llama]
    type: wandb
  wandb: null
"""


def test_a_dumped_config_with_null_defaults_loads(tmp_path: Path) -> None:
    """Levanter writes its whole config, nulls included (llama2_7b.yaml); load_checkpoint_path null is
    the checkpointer's directory, not a second load path."""
    a = load(tmp_path, DUMPED).args
    assert (a.save, a.load) == (f"{tmp_path}/ckpt", f"{tmp_path}/ckpt")
    assert (a.levanter_lr_schedule, a.levanter_warmup, a.levanter_decay) == ("inv", 10, 0.1)
    assert (a.num_kv_heads, a.save_interval, a.tracker.model_dump()["id"]) == (2, "10m", "dumped-0.001")
    assert a.wandb_code_dir == str(tmp_path)  # llama2_7b.yaml's save_code: true is tested with the others below


def test_tensorboard_logdir_gets_the_run_id_and_noop_logs_nowhere(tmp_path: Path) -> None:
    a = load(tmp_path, MODEL + "trainer:\n  id: r9\n  tracker:\n    type: tensorboard\n    logdir: tb\n").args
    assert a.tracker.model_dump()["logdir"] == "tb/r9"  # TensorboardConfig.init: logdir/run_id
    assert load(tmp_path, MODEL + "trainer:\n  tracker:\n    type: noop\n").args.tracker == []


def test_initialize_from_continues_another_run_until_this_one_has_a_checkpoint(tmp_path: Path) -> None:
    a = load(tmp_path, MODEL + "trainer:\n  id: r2\n  initialize_from: {root}/other\n").args
    assert (a.save, a.load) == ("checkpoints/r2", f"{tmp_path}/other")
    with pytest.raises(ConfigError, match="load_checkpoint: true, but checkpoints/r3 holds no checkpoint"):
        load(tmp_path, MODEL + "trainer:\n  id: r3\n  load_checkpoint: true\n")


def test_weight_decay_skips_embeddings_under_levanters_mask() -> None:
    """build_weight_decay_mask's default: no decay for Embedding modules, norms and biases; an untied
    lm_head is decayed."""
    from megatron.model.gpt import GPTModel
    from megatron.engine.optimizers import param_groups
    from tests.gpt_configs import gpt_config

    model = GPTModel(gpt_config(hidden_size=16, num_attention_heads=2, num_layers=1, seq_length=8,
                                max_position_embeddings=8, padded_vocab_size=32, no_weight_tying=True))
    names = {id(p): n for n, p in model.named_parameters()}
    for decay_embeddings, embeddings_decayed in ((True, True), (False, False)):
        decayed = {names[id(p)] for p in param_groups(model, 0.1, decay_embeddings)[0]["params"]}
        assert ("embedding.word_embeddings.weight" in decayed) is embeddings_decayed
        assert ("embedding.position_embeddings.weight" in decayed) is embeddings_decayed
        assert "output_layer.weight" in decayed and not any("norm" in n or n.endswith("bias") for n in decayed)


def test_weight_decay_embeddings_key_reaches_the_optimizer() -> None:
    from megatron.model.gpt import GPTModel
    from megatron.neox_arguments.loading import config_from_mapping
    from megatron.engine.optimizers import build_optimizer
    from tests.gpt_configs import gpt_config

    model = GPTModel(gpt_config(hidden_size=16, num_attention_heads=2, num_layers=1, seq_length=8,
                                max_position_embeddings=8, padded_vocab_size=32))
    embedding = model.embedding.word_embeddings.weight
    for key, decays in ((True, 0.1), (False, 0.0)):
        args = config_from_mapping({"optimizer": {"type": "Adam", "params": {"lr": 0.01}}, "weight_decay": 0.1,
                                    "weight_decay_embeddings": key}).args
        groups = build_optimizer(model, args).param_groups
        assert next(g["weight_decay"] for g in groups if any(p is embedding for p in g["params"])) == decays


MIXTRAL = """\
model:
  type: mixtral
  hidden_dim: 32
  intermediate_dim: 48
  num_heads: 4
  num_kv_heads: 2
  num_layers: 2
  seq_len: 16
trainer:
  mp: p=f32,c=bfloat16
  axis_resources:
    token: "data"
"""


def test_mixtral_builds_levanters_mixture_of_experts(tmp_path: Path) -> None:
    """mixtral_8x7b.yaml's family. MixtralConfig (mixtral.py:65-90@9263f81e): 8 experts, top 2, lbl_coef 0.01,
    rzl_coef 0.001, SwiGLU experts intermediate_dim wide, kv 8, eps 1e-6; _route (344-345) divides the top-2
    softmax weights by their sum; the balance loss lbl_coef * sum_e (load_e * E / k) * P_e (459-462) is
    Deepy's E * sum_e load_e * P_e scaled by lbl_coef / k."""
    from megatron.model.gpt import GPTModel
    from megatron.model.moe import MoELayer
    from tests.gpt_configs import gpt_config

    a = load(tmp_path, MIXTRAL).args
    assert (a.moe_num_experts, a.moe_top_k, a.moe_router_type, a.moe_router_renormalize, a.moe_expert_interval) == \
        (8, 2, "topk", True, 1)
    assert (a.moe_aux_loss_coeff, a.moe_z_loss_coeff) == (pytest.approx(0.01 / 2), 0.001)
    assert (a.activation, a.rms_norm_epsilon, a.rotary_emb_base, a.no_weight_tying) == ("swiglu", 1e-6, 10000, True)
    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_kv_heads", "num_layers", "seq_length",
            "max_position_embeddings", "activation", "norm", "pos_emb", "use_bias_in_mlp", "moe_num_experts",
            "moe_top_k", "moe_router_type", "moe_router_renormalize")
    model = GPTModel(gpt_config(padded_vocab_size=64, **{k: getattr(a, k) for k in keys}))
    # every block's MLP is a mixture, so GPT-NeoX's dense-MLP width rule does not apply: mixtral_8x7b's
    # intermediate_dim 14336 (Levanter's default) would fail it (2/3 of 14336 gives halves of 4779 against a
    # 4778-wide second projection), and is refused where some blocks keep a dense MLP
    from megatron.config_rules import RuleContext
    from megatron.model.checks import mlp_widths_fit

    default = a.model_copy(update={"intermediate_size": 14336, "hidden_size": 4096})
    assert mlp_widths_fit(RuleContext(default)) == []
    assert "4779" in mlp_widths_fit(RuleContext(default.model_copy(update={"moe_expert_interval": 2})))[0]
    for block in model.layers:  # every MLP a mixture; each expert's gate and up halves 48 wide, no biases
        assert isinstance(block.mlp, MoELayer)
        assert tuple(block.mlp.experts.w1.shape) == (8, 32, 2 * 48) and block.mlp.experts.w1_bias is None
        assert tuple(block.mlp.experts.w2.shape) == (8, 48, 32)
    b = load(tmp_path, MIXTRAL.replace("  seq_len: 16\n", "  seq_len: 16\n  n_routed_experts: 4\n"
                                       "  num_experts_per_tok: 1\n  lbl_coef: 0.02\n  rzl_coef: null\n")).args
    assert (b.moe_num_experts, b.moe_top_k, b.moe_aux_loss_coeff, b.moe_z_loss_coeff) == (4, 1, 0.02, 0.0)
    for extra, reason in (("  n_shared_experts: 1\n", "shared experts"), ("  use_bias: true\n", "router has no bias")):
        with pytest.raises(ConfigError, match=reason):
            load(tmp_path, MIXTRAL.replace("  seq_len: 16\n", "  seq_len: 16\n" + extra))
    with pytest.raises(ConfigError, match="a MixtralConfig field"):
        load(tmp_path, MODEL + "  n_routed_experts: 4\n")


def test_save_code_names_the_directory_wandb_saves(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """WandbConfig.save_code (tracker/wandb.py:156-158, 245-256@9263f81e): true by default; true is the git root
    of the launched script's directory (infer_experiment_git_root, tracker/helpers.py:51-73), "." without one;
    a string is that directory; false saves none. Deepy launches train.py, at this repository's root."""
    from megatron.neox_arguments.dialects import levanter_trainer

    repo = Path(__file__).resolve().parents[2]
    root = str(repo) if (repo / ".git").exists() else "."  # a checkout here; "." where the tree is no git one
    wandb = MODEL + "trainer:\n  tracker:\n    type: wandb\n    project: levanter\n    tags: [a]\n"
    assert load(tmp_path, wandb + "    save_code: true\n").args.wandb_code_dir == root  # llama2_7b.yaml's
    assert load(tmp_path, wandb).args.wandb_code_dir == root  # WandbConfig's default
    assert load(tmp_path, MODEL + "trainer:\n  id: r3\n").args.wandb_code_dir == root  # the default tracker's
    assert load(tmp_path, wandb + "    save_code: {root}/code\n").args.wandb_code_dir == f"{tmp_path}/code"
    assert load(tmp_path, wandb + "    save_code: false\n").args.wandb_code_dir is None
    listed = MODEL + "trainer:\n  tracker:\n  - type: tensorboard\n  - type: wandb\n    save_code: {root}/c\n"
    assert load(tmp_path, listed).args.wandb_code_dir == f"{tmp_path}/c"
    assert load(tmp_path, listed.replace("    save_code: {root}/c\n", "")).args.wandb_code_dir == root
    for no_wandb in ("  tracker:\n    type: tensorboard\n", "  tracker:\n    type: noop\n"):
        assert load(tmp_path, MODEL + "trainer:\n" + no_wandb).args.wandb_code_dir is None
    # the frames Levanter skips: a script inside a Python environment has no experiment root, nor one outside git
    assert levanter_trainer.experiment_git_root(repo / "venv" / "lib") is None
    assert levanter_trainer.experiment_git_root(tmp_path) is None
    monkeypatch.setattr(levanter_trainer, "experiment_git_root", lambda: None)
    assert load(tmp_path, wandb).args.wandb_code_dir == "."  # made absolute before launch


def test_run_ids_with_dots_name_the_wandb_run(tmp_path: Path) -> None:
    """llama2_7b.yaml's trainer.id has a dot (llama-8b-tootsie-0.001-19ad63); wandb 0.31.0 reserves only
    :;,#?/' (wandb_settings.py validate_run_id). A leading dot or a slash would leave the checkpoint directory."""
    ok = "llama-8b-tootsie-0.001-19ad63"
    assert load(tmp_path, MODEL + f"trainer:\n  id: {ok}\n").args.tracker.model_dump()["id"] == ok
    for bad in ("../up", "a/b", ".hidden"):
        with pytest.raises(ConfigError, match="tracker.id"):
            load(tmp_path, MODEL + f"trainer:\n  id: '{bad}'\n")


def test_initialize_from_hf_takes_a_local_model_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """train_lm.py:46,79-92@9263f81e: a path or true (the model's reference_checkpoint); not beside
    trainer.initialize_from (line 81); hub names not in the hub cache are refused (test_levanter_hub_and_buckets.py
    reads cached ones)."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty_hub"))
    hf = tmp_path / "hf_llama"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    assert load(tmp_path, MODEL + f"initialize_from_hf: {hf}\n").args.initialize_from_hf == str(hf)
    by_reference = MODEL + f"  reference_checkpoint: {hf}\ninitialize_from_hf: true\n"
    assert load(tmp_path, by_reference).args.initialize_from_hf == str(hf)
    for text, reason in ((MODEL + "initialize_from_hf: meta-llama/Llama-2-7b-hf\n", "downloads nothing"),
                         # Levanter's Gpt2Config converter's reference_checkpoint (gpt2.py:80)
                         (MODEL + "initialize_from_hf: true\n", "Levanter's gpt2 default is gpt2"),
                         # use_hf_model_config reads config.json (here empty): train_lm.py:93-96
                         (MODEL + f"initialize_from_hf: {hf}\nuse_hf_model_config: true\n", "model_type None"),
                         (MODEL + f"initialize_from_hf: {hf}\ntrainer:\n  initialize_from: {tmp_path}\n",
                          "beside trainer.initialize_from")):
        with pytest.raises(ConfigError, match=reason):
            load(tmp_path, text)


@pytest.mark.parametrize(("keys", "message"), [
    ({"max_train_epochs": 2, "train_iters": None, "train_epochs": 3}, "train_epochs already ends the run"),
    ({"max_train_epochs": 2, "use_dummy_dataset": True}, "dummy dataset has no epochs"),
    ({"eval_micro_batch_size_per_gpu": 4, "pipe_parallel_size": 1}, "pipeline engine .* evaluates in training's"),
])
def test_the_new_keys_are_refused_where_they_cannot_act(keys: dict[str, Any], message: str) -> None:
    from megatron.config_rules import Device
    from megatron.neox_arguments import finalize
    from megatron.neox_arguments.arguments import NeoXArgs
    from megatron.neox_arguments.resolved import ResolvedConfig

    base = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32,
            "max_position_embeddings": 32, "train_micro_batch_size_per_gpu": 2, "train_iters": 10,
            "tokenizer_type": "CharLevelTokenizer", "data_path": "data/x_text_document"}
    with pytest.raises(ConfigError, match=message):
        finalize(ResolvedConfig(args=NeoXArgs(**{**base, **keys})), 1, device=Device(cuda=False, fp16_supported=False))
