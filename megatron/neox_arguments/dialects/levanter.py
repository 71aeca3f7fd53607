"""Levanter's dialect: nested ``data/model/trainer/optimizer`` configs and draccus ``--a.b value`` flags.

Meanings and defaults are read from Levanter's code (stanford-crfm/levanter at 9263f81e; the commit and
each fact are listed in ``docs/dialects.md``): ``TrainLmConfig`` (``src/levanter/main/train_lm.py``)
and the sections' classes in ``levanter_model.py``, ``levanter_trainer.py`` and ``levanter_optim.py``.
Each key maps to the GPT-NeoX key(s) that do the same thing here, is accepted at a value that means what
Deepy does anyway (and ``--dry-run`` says why), or is refused with the reason; unknown keys get a
did-you-mean. ``tests/unit/test_dialects.py`` and ``tests/unit/test_levanter_dialect.py`` check the
tables below against YAML written in Levanter's style.
"""

from __future__ import annotations

import os
from typing import Any

from megatron.errors import ConfigError
from megatron.neox_arguments.dialects import (hf_hub, levanter_hf_save, levanter_mixture, levanter_optim, levanter_sft,
                                              levanter_trainer)
from megatron.neox_arguments.dialects.common import Context, Leaf, Refused, Rule, Translation, noted, to
from megatron.neox_arguments.dialects.levanter_model import MODEL_PRESETS, MODEL_RULES, model_type
from megatron.neox_arguments.dialects.levanter_optim import OPTIMIZER_DEFAULTS, OPTIMIZER_RULES
from megatron.neox_arguments.dialects.levanter_trainer import (CHECKPOINTER_DEFAULTS, TRAINER_REFUSED, TRAINER_RULES,
                                                              implied_code_dir, tracker_block)

NAME = "levanter"
SECTIONS = ("data", "model", "trainer", "optimizer")
"""Top-level keys of Levanter's TrainLmConfig; a config holding any of them (as mappings) is Levanter's."""

# ----------------------------------------------------------------------------------------- data


def _tokenizer(value: Any, ctx: Context) -> dict[str, Any]:
    """A tokenizer.json, its directory, or a hub name cached on this machine (``hf_hub.py``)."""
    path = str(value)
    if not os.path.isfile(path):
        path = os.path.join(hf_hub.local_dir(path, "tokenizer.json", "tokenizer.json or its directory"),
                            "tokenizer.json")
    return {"tokenizer_type": "HFTokenizer", "vocab_file": path}


def _enforce_eos(value: Any, ctx: Context) -> dict[str, Any]:
    if not value:
        raise Refused("Deepy ends every document with the tokenizer's end-of-text token when it tokenizes train_urls")
    return noted("Deepy ends every document with the end-of-text token, as Levanter's default does")


def _text_format(value: Any, ctx: Context) -> dict[str, Any]:
    spec = dict(value or {})
    if spec.get("type", "text") != "text" or spec.get("text_key", "text") != "text":
        raise Refused("Deepy tokenizes the 'text' field of jsonl shards; chat and supervised formats are not read")
    return noted("jsonl shards' 'text' field, what Deepy reads")


def _shuffle(value: Any) -> dict[str, Any]:
    """``LMTaskConfig.shuffle`` (text.py:537-539@9263f81e; for a mixture each source, text.py:1234-1253): false reads
    the data in file order, true shuffles it whole, an integer in eras of that many sequences."""
    if value is False:
        return {"data_shuffle": False}
    if value is True:
        return noted("shuffled from the seed: Deepy's sample index (documents, then samples), not Levanter's "
                     "permutation of sequences")
    if isinstance(value, int) and not isinstance(value, bool):
        # text.py:1017-1018: an int > 0 is era_shuffle(value) (EraShufflingDataset, permutation.py:61-110); 0 and 1
        # leave the order as it is (no era shuffle; a permutation of one)
        return {"data_shuffle": value} if value >= 2 else {"data_shuffle": False}
    raise Refused("give true, false or an era length (an integer)")


DATA_RULES: dict[str, Rule] = {
    "data.train_urls": to("train_urls"),
    "data.validation_urls": to("validation_urls"),
    "data.cache_dir": to("cache_dir"),
    "data.tokenizer": _tokenizer,
    "data.enforce_eos": _enforce_eos,
    "data.format": _text_format,
    "data.text_key": lambda v, ctx: _text_format({"text_key": v}, ctx),
    "data.tags": lambda v, ctx: noted("labels for per-source evaluation metrics of mixtures; one source here"),
    "data.cache_options": lambda v, ctx: noted("how Levanter's tokenizing workers batch: speed, not the tokens"),
    "data.shuffle": lambda v, ctx: _shuffle(v),
    "data.permutation_type": lambda v, ctx: noted("unset: Deepy's own shuffle (data.shuffle)") if v is None
    else _refuse("Deepy shuffles with GPT-NeoX's sample index (documents, then samples, from the seed), not "
                 "with Levanter's linear or Feistel permutation"),
    "data.ignore_token_id": lambda v, ctx: noted("no token id is negative, so -100 never masks a real token")
    if v in (None, -100) else _refuse("masking a real token id from the loss is not built here"),
}

_DOWNLOAD = "a Hugging Face dataset, which would be downloaded; give local train_urls/validation_urls"
DATA_REFUSED: dict[str, str] = {
    "data.id": _DOWNLOAD,
    "data.name": _DOWNLOAD,
    "data.stream": _DOWNLOAD,
    "data.vocab_size": "the passthrough tokenizer (token ids as data) is not read in the Levanter dialect",
}


OTHER_ENTRY_POINTS: dict[str, str] = {}
"""Top-level keys of Levanter's other entry points that are not mapped (sft.py's and lora_lm.py's are:
``levanter_sft.py``; the exporters' ``tokenizer`` is sft.py's rule, refused outside an sft.py config)."""


def _refuse(reason: str) -> dict[str, Any]:
    raise Refused(reason)


# -------------------------------------------------------------------------- TrainLmConfig's others


def _eval_harness(value: Any, ctx: Context) -> dict[str, Any]:
    """``eval_harness.task_spec`` -> ``eval_tasks`` (run at every ``eval_interval`` and at the end)."""
    spec = dict(value or {})
    if not spec:
        return {}
    tasks = []
    for task in spec.get("task_spec") or []:
        if isinstance(task, dict):
            extra = set(task) - {"task"}
            if extra:
                raise Refused(f"task options {sorted(extra)} are not read; Deepy's eval_tasks take task names "
                              f"or task YAML files (write a task YAML with them)")
            task = task["task"]
        tasks.append(str(task))
    defaults = {"max_examples": None, "max_eval_length": None, "log_samples": False, "bootstrap_iters": 0,
                "apply_chat_template": False, "confirm_run_unsafe_code": True, "sample_logging": None}
    out: dict[str, Any] = {"eval_tasks": tasks}
    for key, value in spec.items():
        if key == "task_spec":
            continue
        if key == "max_examples" and value is not None:
            # eval_harness.py:577,609@9263f81e: evaluator.evaluate(..., limit=config.max_examples)
            out["eval_tasks_limit"] = int(value)
            continue
        if key not in defaults:
            raise Refused(f"{key!r} is not a field of Levanter's LmEvalHarnessConfig")
        if value != defaults[key] and not (key == "sample_logging" and not value):
            raise Refused(f"eval_harness.{key} is not built here: Deepy runs each of eval_tasks whole, as "
                          f"lm-evaluation-harness defines it")
    # train_lm.py:225-231@9263f81e: the harness is a hook every eval_harness_steps (default 10000, line 68);
    # Levanter's trainer also runs every hook after the last step (trainer.py:449, force=True), as Deepy does
    out["eval_tasks_interval"] = int(ctx.value("eval_harness_steps", 10000))
    return out


def _initialize_from_hf(value: Any, ctx: Context) -> dict[str, Any]:
    """train_lm.py:79-92,155-173@9263f81e: a path (or true: the model's reference_checkpoint) whose weights
    the run starts from at step 0; both with trainer.initialize_from is Levanter's ValueError (line 81)."""
    if value is False or value is None:
        return {}
    sft = levanter_sft.is_sft(ctx)
    if value is True:
        source = levanter_sft.hf_source(ctx) if sft else levanter_sft.reference_checkpoint(ctx)
    else:
        source = value
    if ctx.value("trainer.initialize_from"):
        raise Refused("Levanter refuses initialize_from_hf beside trainer.initialize_from; keep one")
    if source is None:
        raise Refused(f"true reads model.reference_checkpoint, which is not set and has no default here for model "
                      f"type {levanter_sft.raw_model_type(ctx)!r}; give a local model directory or a cached hub name")
    what = "directory save_pretrained wrote"
    if value is True:
        what += " as " + ("model_name_or_path" if sft else "model.reference_checkpoint")
        if not sft and ctx.value("model.reference_checkpoint") is None:
            what += f" (unset: Levanter's {levanter_sft.raw_model_type(ctx)} default is {source})"
    return {"initialize_from_hf": hf_hub.local_dir(str(source), "config.json", what)}


def _data_seed(value: Any, ctx: Context) -> dict[str, Any]:
    if value is None or value == ctx.value("trainer.seed", 0):
        return noted("the data order follows the run's seed")
    raise Refused("Deepy's data order follows the run's seed (trainer.seed); a separate data seed is not built")


def _epoch(value: Any, ctx: Context) -> dict[str, Any]:
    """train_lm.py:66,144@9263f81e and data/text.py:1020: the train set is wrapped in an EpochDataset of
    ``epoch`` passes; the loop stops when the loader runs out (trainer.py:418-428), while the LR
    schedule keeps num_train_steps."""
    if value:
        return {"max_train_epochs": int(value)}
    return noted("0: the data repeats as often as num_train_steps needs")


TOP_RULES: dict[str, Rule] = {
    "z_loss_weight": to("z_loss"),
    "eval_harness": _eval_harness,
    "eval_harness_steps": lambda v, ctx: noted("the interval of eval_harness (set with it: eval_tasks_interval)")
    if ctx.value("eval_harness") else noted("no eval_harness"),
    "initialize_from_hf": _initialize_from_hf,
    # train_lm.py:93-96@9263f81e: with initialize_from_hf, the model is the HF checkpoint's config.json
    "use_hf_model_config": lambda v, ctx: noted("the model: section gives the shape") if not v
    else noted("the model is initialize_from_hf's config.json (train_lm.py:93-96)") if ctx.value("initialize_from_hf")
    else noted("read only with initialize_from_hf (train_lm.py:93): the model: section gives the shape"),
    **levanter_hf_save.TRAIN_LM_RULES,  # hf_save_path, hf_save_steps, hf_save_dtype
    "hf_upload": lambda v, ctx: noted("unset") if v is None else _refuse("uploading to the Hugging Face hub is not "
                                                                         "built (the HF saves stay local)"),
    "data_seed": _data_seed,
    "initialize_from_checkpoint_path": lambda v, ctx: noted("unset") if v is None else
    _refuse("use trainer.initialize_from (weights, optimizer and step of another run)"),
    "epoch": _epoch,
    "log_entropy": lambda v, ctx: noted("off") if not v else _refuse("entropy logging is not built here"),
}

# ----------------------------------------------------------------------------------- everything

RULES: dict[str, Rule] = {**MODEL_RULES, **TRAINER_RULES, **OPTIMIZER_RULES, **DATA_RULES,
                          **levanter_mixture.MIXTURE_RULES, **TOP_RULES,
                          **levanter_sft.SFT_RULES, **levanter_sft.LORA_RULES,
                          **levanter_hf_save.LORA_RULES}
# (over levanter_sft.LORA_RULES' refusal of merged_hf_save_path: the merged HF saves are built, levanter_hf_save.py)
REFUSED: dict[str, str] = {**TRAINER_REFUSED, **DATA_REFUSED, **OTHER_ENTRY_POINTS, **levanter_sft.SFT_REFUSED}
TOP_KEYS = (frozenset(TOP_RULES) | frozenset(OTHER_ENTRY_POINTS) | levanter_sft.SFT_KEYS | levanter_sft.LORA_KEYS
            | frozenset(levanter_sft.SFT_REFUSED))
"""Keys at the top of a Levanter config besides its sections."""
KEEP_WHOLE = (levanter_trainer.KEEP_WHOLE | levanter_optim.KEEP_WHOLE
              | frozenset({"eval_harness", "data.format", "data.cache_options"}) | levanter_sft.KEEP_WHOLE
              | levanter_mixture.KEEP_WHOLE)
"""Mappings read as a whole by their rule."""

LEVANTER_DEFAULTS: dict[str, Any] = {
    "trainer.seed": 0,
    "trainer.num_train_steps": 400_000,
    "trainer.train_batch_size": 512,
    "trainer.steps_per_eval": 1000,
    "trainer.mp": "f32",
    "trainer.log_dir": "logs/",
    "trainer.fsdp_axis": "embed",
    **{f"trainer.checkpointer.{key}": value for key, value in CHECKPOINTER_DEFAULTS.items()},
    **{f"optimizer.{key}": value for key, value in OPTIMIZER_DEFAULTS.items()},
    "optimizer.default_weight_decay_mask": None,
    "data.cache_dir": "cache/",
}
"""Levanter's defaults, read from its config classes (TrainerConfig, CheckpointerConfig, AdamConfig,
OptimizerConfig, LMTaskConfig): a key a Levanter user leaves out means what it means in Levanter."""


def implied(translation: Translation, leaves: dict[str, Leaf], source: str) -> None:
    """The model type's preset and Levanter's defaults, for every GPT-NeoX key nothing explicit set."""
    ctx = Context(leaves)
    levanter_sft.implied(translation, leaves)  # sft.py / lora_lm.py: what they require and imply
    shape = levanter_sft.hf_model(ctx)
    if shape is not None:  # lora_lm.py, sft.py (and train_lm's use_hf_model_config): the model is config.json's
        found = levanter_sft.hf_model_source(ctx)
        assert found is not None
        translation.put(Leaf(f"model from {shape.config_json}", None, f"{shape.config_json} ({found[1]}@9263f81e)"),
                        shape.keys, implied=True)
    kind = model_type(ctx) if shape is None else shape.kind
    where = leaves["model.type"].where if "model.type" in leaves else "Levanter's default (LlamaConfig)"
    preset = dict(MODEL_PRESETS[kind])
    if shape is None and kind != "gpt2" and "model.num_kv_heads" not in leaves and "model.num_heads" in leaves:
        heads, kv = int(leaves["model.num_heads"].value), int(preset["num_kv_heads"])
        if heads % kv:
            raise refused_at(leaves["model.num_heads"], f"num_heads {heads} is not divisible by {kind}'s default "
                             f"num_kv_heads {kv} (Levanter asserts it): give model.num_kv_heads")
    translation.put(Leaf(f"model.type={kind}", kind, where), preset, implied=True)
    # Levanter builds the LR schedule from the config at every launch, also when it resumes
    translation.put(Leaf("schedule from the config", None, "Levanter"), {"override_lr_scheduler": True}, implied=True)
    # Levanter's trainer reports its metrics every step
    translation.put(Leaf("metrics every step", None, "Levanter"), {"log_interval": 1}, implied=True)
    # CausalLmDataset: a token after the end-of-text token starts a new segment of the attention mask
    translation.put(Leaf("documents attend only to themselves", None, "Levanter"), {"reset_attention_mask": True},
                    implied=True)
    if "data.shuffle" not in leaves and not levanter_sft.is_sft(ctx):
        # LMTaskConfig.shuffle defaults to False (text.py:537@9263f81e): train_lm.py and lora_lm.py read their data
        # in order (sft.py permutes its examples: PermutationDataset, sft.py:179)
        translation.put(Leaf("data.shuffle=False", False, "Levanter's default"), _shuffle(False), implied=True)
    for path, value in LEVANTER_DEFAULTS.items():
        if path not in leaves:
            rule = RULES[path]
            default = Leaf(path, value, "Levanter's default")
            translation.put(Leaf(f"{path}={value}", value, "Levanter's default"),
                            rule(value, Context({**leaves, path: default})), implied=True)
    if "trainer.tracker" not in leaves and "trainer.wandb" not in leaves and not any(
            p.startswith(("trainer.tracker.", "trainer.wandb.")) for p in leaves):
        translation.put(Leaf("trainer.tracker=WandbConfig()", None, "Levanter's default"),
                        {"tracker": tracker_block(ctx)}, implied=True)
    code = implied_code_dir(translation.values.get("tracker"))
    if code and "wandb_code_dir" not in translation.values:
        translation.put(Leaf("trainer.tracker.save_code=True", True, "Levanter's default"), code, implied=True)


def refused_at(leaf: Leaf, message: str) -> Exception:
    return ConfigError(f"levanter key {leaf.path} at {leaf.where}: {message}")


__all__ = ["KEEP_WHOLE", "NAME", "REFUSED", "RULES", "SECTIONS", "TOP_KEYS", "implied"]
