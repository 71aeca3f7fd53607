"""``initialize_from_hf``: a run that starts from a local Hugging Face model directory.

``deepy.py`` converts the directory once, before it launches the ranks, with the import tool
(``tools/ckpts/convert_hf_to_neox.py``, run as a child process so the launcher stays free of torch) into
``<save>/hf_import``, at the run's tensor and pipeline split and in its compute dtype, and the run starts
from there as ``initialize_from`` does: weights only, step 0, a fresh optimizer, and only while ``save``
holds no checkpoint of the run's own (a restart resumes that one). This is Levanter's
``initialize_from_hf`` (``src/levanter/main/train_lm.py:155-173`` at 9263f81e: the HF weights are read
when the step is 0, in the compute dtype, then cast to the parameter dtype).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron.config_rules import RuleContext, render, rule
from megatron.errors import ConfigError, ConversionError
from megatron.interop.hf_keys import MATH_KEYS, neox_model_keys, read_config_json
from megatron.model.family_config import expand_layer_types
from megatron.model.transformer_options import ATTENTION_TYPES

IMPORT_DIR = "hf_import"
"""Folder under ``save`` that receives the converted model."""
CONVERTED_MARKER = "deepy_model.yml"
"""Written last by the import tool: its presence means the conversion finished."""
_PRECISION = {"bfloat16": "bf16", "fp16": "fp16", "fp32": "fp32"}
REPO = Path(__file__).resolve().parents[2]


@rule
def initialize_from_hf_is_a_local_model(ctx: RuleContext) -> list[str]:
    source = ctx.get("initialize_from_hf")
    if not source:
        return []
    problems = []
    if not (Path(str(source)) / "config.json").is_file():
        problems.append(f"{ctx.show('initialize_from_hf')} is not a local transformers model directory (no "
                        f"config.json there); nothing is downloaded: give the directory save_pretrained wrote")
    if ctx.get("initialize_from"):
        problems.append(f"{ctx.show('initialize_from_hf')} and {ctx.show('initialize_from')}: a run starts from "
                        f"one of them; keep one")
    if not ctx.get("save"):
        problems.append(f"{ctx.show('initialize_from_hf')} needs save: the model is converted into "
                        f"<save>/{IMPORT_DIR} before launch")
    return problems


_NOT_COMPARED = ("sliding_window_width",)
"""Read only with a "local" attention type (attention_config), which the import sets itself."""


def _comparable(key: str, value: Any, keys: dict[str, Any]) -> Any:
    """``value`` of ``key`` in the form both sides share (unset kv heads are one per head; HF's rope dict
    spellings)."""
    if key == "num_kv_heads" and value is None:
        return keys["num_attention_heads"]
    if key == "attention_config":  # Gemma's local/global layers, however the list spells them (flash is global)
        layers = int(keys["num_layers"])
        try:
            types = expand_layer_types(value or [[["global"], layers]], layers)
        except (ValueError, TypeError):
            return value  # the attention_config check says why
        return ["local" if t in ATTENTION_TYPES and ATTENTION_TYPES[t].windowed else
                "global" if t in ATTENTION_TYPES else t for t in types]
    if key == "rope_scaling" and isinstance(value, dict):
        out = {k: float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v for k, v in value.items()
               if k not in ("rope_theta", "partial_rotary_factor", "type")}
        out["rope_type"] = value.get("rope_type") or value.get("type")
        return out
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return value


@rule
def initialize_from_hf_agrees_with_its_config(ctx: RuleContext) -> list[str]:
    """Every key that changes the model's maths (``hf_keys.MATH_KEYS``: shape, norm and its epsilon, rope theta and
    scaling, activation, tied embeddings, biases, ...) equals what the model directory's config.json says; the
    weights would load into another model otherwise (a Llama's rms_norm_eps 1e-6 trained at 1e-5)."""
    source = ctx.get("initialize_from_hf")
    if not source or not (Path(str(source)) / "config.json").is_file():
        return []  # initialize_from_hf_is_a_local_model says why
    try:
        cfg = read_config_json(str(source))
        if cfg.get("model_type") == "mamba":
            return []  # the import's Mamba mapping (hf_mamba.py) checks its own keys
        keys = neox_model_keys(cfg)
    except ConversionError as err:
        return [f"{ctx.show('initialize_from_hf')}: the import cannot read {source}/config.json: {err}"]
    if keys.get("rope_scaling") is None and ctx.get("rope_scaling") is not None:
        # a context extension of a model trained without one: the weights are the same, the positions are
        # scaled on purpose (the key is the user's, written beside initialize_from_hf)
        ctx.warnings.append(f"{ctx.show('rope_scaling')}: {source}/config.json has no rope scaling; the imported "
                            "model runs with this one (a context extension)")
        keys = {k: v for k, v in keys.items() if k != "rope_scaling"}
    return [f"{ctx.show(key)}: {source}/config.json gives {key} {render(keys[key])}; the model would compute "
            f"something else than the checkpoint (set {key}: {render(keys[key])})"
            for key in MATH_KEYS if key in keys and key not in _NOT_COMPARED
            and _comparable(key, ctx.get(key), keys) != _comparable(key, keys[key], keys)]


Runner = Callable[[Sequence[str]], "subprocess.CompletedProcess[str]"]


def _run(argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)}
    return subprocess.run(list(argv), capture_output=True, text=True, env=env)


@dataclass(frozen=True)
class HfImport:
    """What the conversion reads from the resolved config (the app builds it there): the local model, the run's
    ``save``, its tensor and pipeline split, compute dtype and sequence length."""

    source: str
    save: Path
    tensor_parallel: int
    pipe_parallel: int
    precision: str
    seq_length: int

    @property
    def target(self) -> Path:
        """Where the converted model goes, and where the run starts from (its ``initialize_from``)."""
        return self.save / IMPORT_DIR


def import_command(plan: HfImport) -> list[str]:
    """The import tool's command: the run's split and compute dtype."""
    return [sys.executable, str(REPO / "tools" / "ckpts" / "convert_hf_to_neox.py"), plan.source,
            str(plan.target), "--tp", str(plan.tensor_parallel), "--pp", str(plan.pipe_parallel),
            "--precision", _PRECISION.get(plan.precision, "auto"), "--seq-length", str(plan.seq_length),
            "--no-verify"]


def start_from_hf(plan: HfImport, has_own_checkpoint: bool, run: Runner = _run) -> str:
    """Convert ``plan.source`` into ``plan.target`` when the run starts afresh and it is not converted yet;
    returns what was done (for the launch notes). The caller points ``initialize_from`` at ``plan.target``.
    ``run`` executes the import tool (tests inject their own)."""
    if has_own_checkpoint:
        return f"initialize_from_hf: the run resumes its own checkpoint in {plan.save}; {plan.target} is not read"
    if (plan.target / CONVERTED_MARKER).is_file():
        return f"initialize_from_hf: starting from {plan.target} (converted by an earlier launch)"
    proc = run(import_command(plan))
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-10:])
        raise ConfigError(f"initialize_from_hf: converting {plan.source} failed:\n{tail}")
    return f"initialize_from_hf: converted {plan.source} into {plan.target}; the run starts from its weights"
