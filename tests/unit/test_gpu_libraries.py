"""The CUDA-only library keys (issue 47, item 5) on a machine without them: Transformer Engine's ``te_*`` keys and
``norm: te_rmsnorm|te_layernorm``, bitsandbytes' ``use_bnb_optimizer``. Where the library or the GPU is missing
they are refused before launch by name and place; the pure parts of what they build (which modules are swapped,
the FP8 recipe, the norm kinds, Adam8bit's arguments) are checked here against GPT-NeoX ea7aefd8's code,
re-derived. The modules themselves run in tests/unit/test_gpu_libraries_device.py (NVIDIA GPU only).
DeepSpeed 0.19.8 removed the block-sparse attention kernels: sparsity_config and those attention types are
obsolete."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from megatron.config_schema import BITSANDBYTES, TRANSFORMER_ENGINE, gpu_library_missing
from megatron.engine.bnb import adam8bit_arguments
from megatron.engine.optimizer_config import OptimizerArgs
from megatron.errors import ConfigError
from megatron.model.checks import TE_MLP_ACTIVATIONS
from megatron.model.transformer_engine import fp8_recipe_arguments, te_normalization, te_swaps
from megatron.neox_arguments.loading import load_config
from tests.gpt_configs import gpt_config

REPO = Path(__file__).resolve().parents[2]
CAN_RUN_TE = gpu_library_missing(TRANSFORMER_ENGINE) is None
CAN_RUN_BNB = gpu_library_missing(BITSANDBYTES) is None


# --- GPT-NeoX ea7aefd8, re-derived ------------------------------------------------------------------------
def neox_recipe(te_fp8_format: str, te_fp8_wgrad: bool, te_fp8_amax_history_len: int, te_fp8_amax_compute_algo: str,
                te_fp8_margin: int, te_fp8_mha: bool) -> dict[str, Any]:
    """megatron/model/transformer_engine.py TEDelayedScaling.__init__, with its two slips mended (it reads
    ``neox_args.fp8_margin`` and passes the undefined ``te_fp8_format``: the te_fp8_margin key and the format
    it has just chosen are meant)."""
    if te_fp8_format == "e4m3":
        fp8_format = "E4M3"
    elif te_fp8_format == "hybrid":
        fp8_format = "HYBRID"
    override_linear_precision = (False, False, not te_fp8_wgrad)
    return dict(margin=te_fp8_margin, fp8_format=fp8_format, amax_compute_algo=te_fp8_amax_compute_algo,
                amax_history_len=te_fp8_amax_history_len, override_linear_precision=override_linear_precision,
                fp8_mha=te_fp8_mha)


def neox_modules(te_columnparallel: bool, te_rowparallel: bool, te_layernorm_mlp: bool, te_mha: bool,
                 te_fp8_mha: bool) -> dict[str, bool]:
    """Which of a block's modules GPT-NeoX builds with Transformer Engine: utils.py get_parallel_linear,
    transformer.py:962 (attention), :993/:1020 (norm + MLP), :1052 (fp8 context)."""
    return {"column_linears": te_columnparallel, "row_linears": te_rowparallel,
            "attention": bool(te_mha or te_fp8_mha), "layernorm_mlp": te_layernorm_mlp, "fp8": te_fp8_mha}


@pytest.mark.parametrize("keys", [
    dict(te_fp8_format="hybrid", te_fp8_wgrad=True, te_fp8_amax_history_len=1, te_fp8_amax_compute_algo="most_recent",
         te_fp8_margin=0, te_fp8_mha=True),
    dict(te_fp8_format="e4m3", te_fp8_wgrad=False, te_fp8_amax_history_len=16, te_fp8_amax_compute_algo="max",
         te_fp8_margin=2, te_fp8_mha=False),
])
def test_the_fp8_recipe_is_built_from_the_te_fp8_keys_as_gpt_neox_means(keys: dict[str, Any]) -> None:
    assert fp8_recipe_arguments(gpt_config(**keys)) == neox_recipe(**keys)


@pytest.mark.parametrize("flags", [(c, r, m, a, f) for c in (False, True) for r in (False, True)
                                   for m in (False, True) for a in (False, True) for f in (False, True)])
def test_te_columnparallel_rowparallel_layernorm_mlp_mha_swap_what_gpt_neox_swaps(flags: tuple[bool, ...]) -> None:
    names = ("te_columnparallel", "te_rowparallel", "te_layernorm_mlp", "te_mha", "te_fp8_mha")
    keys = dict(zip(names, flags))
    swaps = te_swaps(gpt_config(**keys))
    assert {k: getattr(swaps, k) for k in neox_modules(**keys)} == neox_modules(**keys)
    assert swaps.any == any(flags)


def test_te_norm_kinds_and_epsilons_are_gpt_neox_s() -> None:
    # TELayerNormMLP / TEMultiheadAttention: fixed epsilons whatever layernorm_epsilon / rms_norm_epsilon say
    assert te_normalization("layernorm") == te_normalization("te_layernorm") == ("LayerNorm", 1.0e-5)
    assert te_normalization("rmsnorm") == te_normalization("te_rmsnorm") == ("RMSNorm", 1.0e-8)
    with pytest.raises(ConfigError, match="LayerNorm or RMSNorm"):
        te_normalization("scalenorm")
    assert TE_MLP_ACTIVATIONS == ("gelu", "geglu", "relu", "reglu", "squared_relu", "swiglu", "qgelu", "srelu")


def test_use_bnb_optimizer_hands_adam8bit_adams_settings_and_the_groups() -> None:
    cfg = OptimizerArgs.model_validate({"use_bnb_optimizer": True, "optimizer": {"type": "Adam", "params": {
        "lr": 3e-4, "betas": [0.8, 0.95], "eps": 1e-6}}})
    groups: list[dict[str, Any]] = [{"params": [], "weight_decay": 0.1}, {"params": [], "weight_decay": 0.0}]
    # GPT-NeoX (training.py:1057-1071): Adam8bit(param_groups, weight_decay=..., **optimizer["params"])
    assert adam8bit_arguments(groups, cfg) == {"params": groups, "lr": 3e-4, "betas": (0.8, 0.95), "eps": 1e-6}


# --- refused where the library or the GPU is missing ------------------------------------------------------
GPU_KEYS = {"te_columnparallel": "true", "te_rowparallel": "true", "te_layernorm_mlp": "true", "te_mha": "true",
            "te_fp8_format": "e4m3", "te_fp8_wgrad": "false", "te_fp8_amax_history_len": "8",
            "te_fp8_amax_compute_algo": "max", "te_fp8_margin": "1", "te_fp8_mha": "true", "norm": "te_rmsnorm",
            "use_bnb_optimizer": "true"}


@pytest.mark.skipif(CAN_RUN_TE and CAN_RUN_BNB, reason="this machine runs Transformer Engine and bitsandbytes")
@pytest.mark.parametrize("key", sorted(GPU_KEYS))
def test_a_gpu_library_key_is_refused_with_library_package_and_place(key: str, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    Path("neox.yml").write_text(f"num_layers: 2\n{key}: {GPU_KEYS[key]}\n")
    library = "bitsandbytes" if key == "use_bnb_optimizer" else "Transformer Engine"
    with pytest.raises(ConfigError) as info:
        load_config(["neox.yml"])
    message = info.value.message
    assert f"  {key}: " in message and f"needs {library} (pip package " in message and "neox.yml:2" in message
    assert "requirements/requirements-kernels.txt) on an NVIDIA GPU; " in message and "not supported yet" not in message
    Path("default.yml").write_text("num_layers: 2\nte_mha: false\nnorm: rmsnorm\nuse_bnb_optimizer: false\n")
    assert load_config(["default.yml"]).args.num_layers == 2  # at the default (or a torch norm): accepted


@pytest.mark.skipif(CAN_RUN_TE, reason="this machine runs Transformer Engine")
def test_deepy_refuses_te_mha_before_launch_with_exit_code_2(tmp_path: Path) -> None:
    config = tmp_path / "te.yml"
    config.write_text("te_mha: true\n")
    result = subprocess.run([sys.executable, str(REPO / "deepy.py"), "--dry-run", str(REPO / "train.py"),
                             str(REPO / "configs" / "tiny.yml"), str(config)], capture_output=True, text=True,
                            cwd=tmp_path, timeout=120)
    assert result.returncode == 2, result.stderr
    assert "te_mha: True needs Transformer Engine (pip package transformer-engine" in result.stderr
    assert "te.yml:1" in result.stderr and "Traceback" not in result.stderr
    assert result.stderr.count("deepy: config error:") == 1


def test_the_machine_check_says_what_is_missing() -> None:
    import importlib.util

    import torch

    missing = gpu_library_missing(TRANSFORMER_ENGINE) or ""
    assert ("this machine has no GPU" in missing) == (not torch.cuda.is_available())
    assert ("not installed" in missing) == (importlib.util.find_spec("transformer_engine") is None)


@pytest.mark.parametrize("kind", ["sparse_fixed", "sparse_variable", "bigbird", "bslongformer", "ring"])
def test_sparse_and_ring_attention_types_are_refused_as_obsolete(kind: str, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    Path("neox.yml").write_text(f"num_layers: 2\nattention_config: [[[global, {kind}], 1]]\n")
    with pytest.raises(ConfigError) as info:
        load_config(["neox.yml"])
    message = info.value.message
    assert f"attention type {kind} is obsolete: " in message and "neox.yml:2" in message
    assert ("DeepSpeed 0.19.8" if kind != "ring" else "ATTENTION_TYPE_CHOICES has no ring") in message
    assert "not supported yet" not in message
