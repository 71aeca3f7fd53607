"""Every module that registers before-launch checks, so :func:`megatron.config_rules.check` sees them all.

A component registers the checks of its own keys with ``@rule`` beside them; nothing imports those
modules for their checks alone, so they are listed here, once, and the argument layer imports this
module before it checks a config (``megatron/neox_arguments/derived.py``).
``tests/unit/test_config_rules.py`` fails when a module under ``megatron/`` uses ``@rule`` and is
missing from :data:`CHECK_MODULES`. :func:`ordered_rules` reports problems in this order, whichever
module happened to be imported first.
"""

from __future__ import annotations

from types import ModuleType

from megatron import plugins
from megatron.config_rules import RULES, Rule
from megatron.checkpointing import resume_checks as checkpoint_checks
from megatron.checkpointing.neox import checks as neox_checks
from megatron.data import checks as data_checks
from megatron.data import mixture_checks
from megatron.data import stream_checks
from megatron.evaluation import checks as evaluation_checks
from megatron.interop import hf_start
from megatron.launcher import checks as launcher_checks
from megatron.logging import preflight
from megatron.model import checks as model_checks
from megatron.model import config as model_config
from megatron.model import family_checks, lora_checks, moe_checks, mup_checks, option_checks
from megatron.model import gemma_checks
from megatron.mpu import parallel_config
from megatron.neox_arguments import deepspeed_blocks, file_checks, optional_packages, rules
from megatron.engine import compile_checks, lr_config, lr_dialects
from megatron.training import averaging_config, bad_steps, eval_checks, length_checks
from megatron.training import curriculum
from megatron.engine import optimizer_checks
from megatron.training import hang_config, hf_save_config, peft_config, reinit_config
from megatron.objectives import checks as objective_checks
from megatron.objectives import reinforce_checks

CHECK_MODULES: tuple[ModuleType, ...] = (
    plugins,  # each plug-in's own keys
    lr_config,
    lr_dialects,  # Levanter's and fms-fsdp's curves read only their own keys
    objective_checks,
    reinforce_checks,  # train_impl: reinforce, dataset_impl: online, serve_model_weights
    model_checks,
    model_config,  # attention_config covers the layers
    gemma_checks,  # query_pre_attn_scalar, attn_logit_softcapping, rope_local_base_freq
    rules,  # the rules between components
    parallel_config,  # pipe_partition_method
    optimizer_checks,
    averaging_config,  # ema_beta (ZeRO-3)
    bad_steps,  # skip_bad_steps_window
    curriculum,  # curriculum_learning, data_efficiency
    hang_config,  # hang_timeout, startup_hang_timeout
    reinit_config,  # reinit_tokens
    peft_config,  # lora_peft_save_path (tp, pp, ZeRO-3, targets)
    hf_save_config,  # hf_save_path (tp, pp, ZeRO-3, experts, reward models)
    length_checks,
    eval_checks,  # char_level_ppl
    compile_checks,
    checkpoint_checks,
    neox_checks,  # neox_qkv_order
    hf_start,  # initialize_from_hf
    data_checks,
    mixture_checks,  # train_data_weights_schedule, mixture_block_size, jsonl entries of *_data_paths
    stream_checks,  # streaming, stream_shards
    evaluation_checks,  # eval_tasks
    launcher_checks,
    preflight,  # trackers and profiling
    moe_checks,
    option_checks,  # num_unique_layers, fp16_lm_cross_entropy, soft_prompt_tuning, mamba_selective_fp32_params
    family_checks,
    lora_checks,
    mup_checks,  # use_mup, base_shapes_file, coord_check
    file_checks,
    deepspeed_blocks,
    optional_packages,
)
"""The modules whose ``@rule`` functions make up :data:`megatron.config_rules.RULES`."""


def ordered_rules() -> list[Rule]:
    """Every registered check, module by module in :data:`CHECK_MODULES` order, each module's checks in
    the order it defines them."""
    position = {module.__name__: index for index, module in enumerate(CHECK_MODULES)}
    return sorted(RULES, key=lambda fn: position.get(fn.__module__, len(position)))
