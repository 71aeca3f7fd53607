"""GPT-NeoX's obsolete keys are refused with the reason and what to use instead, not as "not supported yet"
(issue 47, item 6): each is for something the anchors removed (DeepSpeed 0.19.8's Apex AMP and sparse gradients)
or that GPT-NeoX's training never uses (its code at ea7aefd: ``short_seq_prob`` and ``deepscale*`` are read
nowhere, ``adlr_autoresume`` imports NVIDIA's internal cluster library, ``lazy_mpu_init`` hands the model-parallel
set-up to an outside framework, ``onnx_safe`` picks GELU's erf form for ONNX, ``scheduler`` is filled in only
for OneBitAdam, ``deepspeed: false`` has no other engine, ``data_impl: cached`` reads the legacy
non-memory-mapped files). At the default a key is accepted, so GPT-NeoX's configs that spell the default load."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from megatron.errors import ConfigError
from megatron.neox_arguments.arguments import NeoXArgs
from megatron.neox_arguments.docs import render_markdown, support_note
from megatron.neox_arguments.loading import load_config

REPO = Path(__file__).resolve().parents[2]

OBSOLETE = {
    "adlr_autoresume": "true", "adlr_autoresume_interval": "50", "onnx_safe": "true", "deepscale": "true",
    "deepscale_config": "ds.json", "amp": "{enabled: true}", "sparse_gradients": "true", "short_seq_prob": "0.2",
    "lazy_mpu_init": "true", "deepspeed": "false", "scheduler": "{type: WarmupLR}", "data_impl": "cached",
    # DeepSpeed 0.19.8 removed these blocks (runtime/config.py _REMOVED_TOP_LEVEL_CONFIG_KEYS); its autotuner
    # re-runs train.py with unchecked configs; curriculum_seqlen is the curriculum's state, not a setting
    "elasticity": "{enabled: true}", "compression_training": "{weight_quantization: {}}",
    "sparse_attention": "{mode: fixed}", "autotuning": "{enabled: true}", "autotuning_run": "tune",
    "curriculum_seqlen": "64",
    # the settings of DeepSpeed's block-sparse attention, gone from DeepSpeed 0.19.8 (megatron/config_support.py)
    "sparsity_config": "{block: 16}",
    # GPT-NeoX's slot for the live Comet experiment its initialize_comet creates, not a setting
    "comet_experiment": "x",
    # token dropping beyond expert capacity: GPT-NeoX removed it (d11df961, #1210); its MoE is dropless
    "moe_token_dropping": "true",
}
"""Issue 47's list of obsolete keys, each with a value GPT-NeoX accepts that Deepy refuses."""


def test_the_obsolete_keys_are_the_issues_list() -> None:
    assert {name for name in NeoXArgs.field_names() if NeoXArgs.obsolete_reason(name)} == set(OBSOLETE)


@pytest.mark.parametrize("key", sorted(OBSOLETE))
def test_an_obsolete_key_is_refused_with_its_reason_and_place(key: str, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    Path("neox.yml").write_text(f"num_layers: 2\n{key}: {OBSOLETE[key]}\n")
    with pytest.raises(ConfigError) as info:
        load_config(["neox.yml"])
    message = info.value.message
    reason = NeoXArgs.obsolete_reason(key)
    assert reason is not None and ("use " in reason or "remove" in reason), reason  # says what to do instead
    assert f"{key}: " in message and "is obsolete: " + reason in message and "neox.yml:2" in message
    assert "not supported yet" not in message
    # at the default, the key is accepted (GPT-NeoX's own configs spell some defaults)
    Path("default.yml").write_text(f"num_layers: 2\n{key}: {NeoXArgs.model_fields[key].get_default()!r}\n"
                                   .replace("'", "\"").replace("None", "null").replace("True", "true")
                                   .replace("False", "false"))
    assert load_config(["default.yml"]).args.num_layers == 2


def test_obsolete_and_missing_features_are_told_apart_in_one_message(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                    key_not_supported_yet: str) -> None:
    monkeypatch.chdir(tmp_path)
    Path("both.yml").write_text("use_mup: true\namp: {enabled: true}\n")
    with pytest.raises(ConfigError) as info:
        load_config(["both.yml"])
    message = info.value.message
    assert message.index("does not support yet:") < message.index("use_mup") < message.index("obsolete keys:") \
        < message.index("amp: ")


def test_the_reference_page_says_why_not_not_supported_yet() -> None:
    page = render_markdown()
    for key in OBSOLETE:
        note = support_note(key)
        assert note.startswith("obsolete") and "not supported yet" not in note, (key, note)
        row = next(line for line in page.splitlines() if line.startswith(f"| `{key}` |"))
        assert "| obsolete" in row and "not supported yet" not in row, row


def test_deepy_refuses_one_before_launch_with_exit_code_2(tmp_path: Path) -> None:
    config = tmp_path / "old.yml"
    config.write_text("scheduler: {type: WarmupLR}\n")
    result = subprocess.run([sys.executable, str(REPO / "deepy.py"), "--dry-run", str(REPO / "train.py"),
                             str(REPO / "configs" / "tiny.yml"), str(config)], capture_output=True, text=True,
                            cwd=tmp_path, timeout=120)
    assert result.returncode == 2, result.stderr
    assert "scheduler" in result.stderr and "is obsolete" in result.stderr and "lr_decay_style" in result.stderr
    assert "Traceback" not in result.stderr and result.stderr.count("is obsolete") == 1
