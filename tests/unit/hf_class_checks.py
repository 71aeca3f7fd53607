"""The checks each Hugging Face class test (test_qwen2, test_qwen3, test_phi3, test_olmo2, test_gemma,
test_moe_models) makes of a tiny transformers model in and out of Deepy, written once.

The model is transformers' own, built from a config with seeded random weights and its norm gains and biases moved
off their ones/zeros so a dropped or misplaced one shows (nothing downloaded). Against it: the parameter count
three ways and the logits of the imported model; a round trip (import at tp2·pp2, export back: every tensor and
the named config.json keys unchanged); one training step on the imported weights, exported again, whose logits
transformers computes too; the check before launch of an ``initialize_from_hf`` directory; a preset's parameter
count against transformers' model of the published sizes on the meta device. Every logit comparison runs both
models here, not through the converter's built-in check (that one is asserted as well).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
import yaml
from safetensors.torch import load_file

from megatron.interop.convert import export_to_hf, import_to_deepy
from megatron.interop.deepy_checkpoint import read_full_checkpoint, write_weights_only_checkpoint
from megatron.interop.hf_config import choose_architecture, gpt_config_from_hf
from megatron.interop.hf_model import fixed_batch
from megatron.interop.hf_tokenizer import TokenizerFiles, export_tokenizer
from megatron.interop.hf_weights import from_hf_state_dict
from megatron.model import GPTConfig, GPTModel, num_parameters
from test_model_families import assert_greedy_generation_equals_transformers

if TYPE_CHECKING:
    from megatron.neox_arguments import NeoXArgs

REPO = Path(__file__).resolve().parents[2]
Imported = tuple[Any, GPTConfig, GPTModel]
"""transformers' model, our config of it and our model holding its weights (``imported_model``)."""
TOLERANCE = 1e-4
"""The largest logit difference allowed between Deepy's model and transformers' (fp32)."""
# the config.json keys every class writes back as it read them; each test adds its class's own
CONFIG_KEYS: tuple[str, ...] = ("model_type", "vocab_size", "hidden_size", "num_attention_heads",
                                "num_key_value_heads", "num_hidden_layers", "rope_parameters", "tie_word_embeddings",
                                "max_position_embeddings", "rms_norm_eps")  # fmt: skip


def perturbed_model(config: Any, seed: int, scale: float = 0.2) -> Any:
    """transformers' model of ``config`` (random weights from ``seed``), in eval mode, with every norm gain and
    bias moved by ``scale`` x N(0, 1): norms start as ones (Gemma's as zeros), biases as zeros, and would hide a
    dropped or misplaced one."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.add_(scale * torch.randn_like(param))
    return model.eval()


def save_with_tokenizer(model: Any, out: Path) -> Path:
    """``model`` saved to ``out`` with a character-level tokenizer: a directory the converter imports."""
    model.save_pretrained(out)
    export_tokenizer(TokenizerFiles("CharLevelTokenizer"), out, 64)
    return out


def hf_model(model_dir: Path) -> Any:
    """transformers' model of a saved directory, in fp32 and eval mode."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True).eval()


def imported_model(theirs: Any, hf_class: str | None = None) -> tuple[GPTConfig, GPTModel]:
    """Our config of transformers' model ``theirs`` (sequence length 32) and our model holding its weights, read
    as the class the config exports as (``hf_class`` Phi3ForCausalLM: Phi-3's fused projections)."""
    config = gpt_config_from_hf(theirs.config, seq_length=32)
    ours = GPTModel(config).eval()
    ours.load_state_dict(from_hf_state_dict(config, choose_architecture(config, hf_class), theirs.state_dict()))
    return config, ours


def assert_generation_equals_transformers(imported: Imported) -> None:
    """Our greedy decode of the imported model equals transformers' ``generate``
    (``test_model_families.assert_greedy_generation_equals_transformers``)."""
    theirs, config, ours = imported
    assert_greedy_generation_equals_transformers(ours, theirs, vocab=config.vocab, hidden=config.arch.hidden)


def assert_counts_and_logits_equal(theirs: Any, config: GPTConfig,
                                   ours: GPTModel) -> tuple[torch.Tensor, torch.Tensor]:
    """The parameter count three ways (the registry's, the module's, transformers') and the logits of a 24-token
    batch within ``TOLERANCE``; returns the batch and transformers' logits of it."""
    hf_count = sum(p.numel() for p in theirs.parameters())
    assert num_parameters(config) == sum(p.numel() for p in ours.parameters()) == hf_count
    tokens = fixed_batch(config.vocab, 24)
    with torch.no_grad():
        want = theirs(input_ids=tokens).logits
        delta = (ours(tokens) - want).abs().max().item()
    assert delta <= TOLERANCE
    return tokens, want


def max_logit_diff(config: GPTConfig, weights: Mapping[str, torch.Tensor], tokens: torch.Tensor,
                   want: torch.Tensor) -> float:
    """How far from ``want`` the logits of the model ``config`` builds, holding ``weights``, are: a key undone in
    our config alone must move them."""
    other = GPTModel(config).eval()
    other.load_state_dict(weights)
    with torch.no_grad():
        return (other(tokens) - want).abs().max().item()


@dataclass(frozen=True)
class RoundTrip:
    deepy: Path
    """The imported checkpoint (tp2·pp2)."""
    written: str
    """The imported checkpoint's config file."""
    back: dict[str, torch.Tensor]
    """The exported model.safetensors."""
    config_a: dict[str, Any]
    """The source's config.json."""
    config_b: dict[str, Any]
    """The export's config.json."""


def assert_round_trip_at_tp2_pp2(source: Path, tmp_path: Path, architecture: str, config_keys: Iterable[str],
                                 hf_class: str | None = None) -> RoundTrip:
    """``source`` imported at tp2·pp2 and exported back (as ``hf_class`` where given) as ``architecture``, both
    within ``TOLERANCE`` by the converter's own check: every tensor equal to the source's, each of ``config_keys``
    the same in both config.json files."""
    imported = import_to_deepy(source, tmp_path / "deepy", tp=2, pp=2)
    assert imported.max_logit_diff is not None and imported.max_logit_diff <= TOLERANCE
    exported = export_to_hf(tmp_path / "deepy", tmp_path / "back", hf_class=hf_class)
    assert exported.architecture == architecture
    assert exported.max_logit_diff is not None and exported.max_logit_diff <= TOLERANCE
    original, back = load_file(source / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert set(original) == set(back) and all(torch.equal(original[k], back[k]) for k in original)
    config_a = json.loads((source / "config.json").read_text())
    config_b = json.loads((tmp_path / "back" / "config.json").read_text())
    for key in config_keys:
        assert config_a.get(key) == config_b.get(key), key
    return RoundTrip(tmp_path / "deepy", imported.config_file.read_text(), back, config_a, config_b)


def assert_a_trained_step_exports(deepy: Path, tmp_path: Path, moved: Iterable[str] = (),
                                  hf_class: str | None = None) -> Any:
    """One SGD step (lr 0.5) on the full weights of checkpoint ``deepy`` (each of ``moved`` changes), written at
    tp1·pp1 and exported (as ``hf_class`` where given): transformers' logits of the export within ``TOLERANCE``
    of the trained model's. Returns transformers' model of the export."""
    full = read_full_checkpoint(deepy)
    model = GPTModel(full.config)
    model.load_state_dict(full.weights)
    tokens = fixed_batch(full.config.vocab, 17)
    loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    torch.optim.SGD(model.parameters(), lr=0.5).step()
    trained = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for key in moved:
        assert not torch.equal(trained[key], full.weights[key]), key
    write_weights_only_checkpoint(tmp_path / "trained", config=full.config, weights=trained, tp=1, pp=1, step=1,
                                  args=full.args)  # fmt: skip
    export_to_hf(tmp_path / "trained", tmp_path / "trained_hf", hf_class=hf_class)
    theirs = hf_model(tmp_path / "trained_hf")
    model.eval()
    with torch.no_grad():
        delta = (model(tokens) - theirs(input_ids=tokens).logits).abs().max().item()
    assert delta <= TOLERANCE
    return theirs


def hf_start_args(hf_config: Any, directory: Path) -> tuple[dict[str, Any], NeoXArgs]:
    """``hf_config`` saved to ``directory`` and read as the check before launch reads it (plain JSON): its model
    keys, and the arguments they make with ``initialize_from_hf`` set, which the check passes."""
    from megatron.interop.hf_keys import neox_model_keys, read_config_json
    from megatron.neox_arguments import NeoXArgs

    hf_config.save_pretrained(directory)
    model = neox_model_keys(read_config_json(directory))
    args = NeoXArgs(**{k: v for k, v in model.items() if k in NeoXArgs.model_fields},
                    initialize_from_hf=str(directory))
    assert start_problems(args) == []
    return model, args


def start_problems(args: NeoXArgs, **update: Any) -> list[str]:
    """What the check before launch says of ``args`` with ``update``."""
    from megatron.config_rules import RuleContext
    from megatron.interop.hf_start import initialize_from_hf_agrees_with_its_config

    return initialize_from_hf_agrees_with_its_config(RuleContext(args.model_copy(update=update)))


def assert_each_change_is_named(args: NeoXArgs, changes: Iterable[tuple[str, Any]]) -> None:
    """Each (key, value) set alone in ``args``: the check before launch says one problem, naming the key."""
    for key, value in changes:
        problems = start_problems(args, **{key: value})
        assert len(problems) == 1 and key in problems[0], problems


def preset_config(preset: str, **extra: Any) -> GPTConfig:
    """Our config of ``configs/<preset>`` (its model keys, ``-`` read as ``_``), with ``extra``."""
    keys = yaml.safe_load((REPO / "configs" / preset).read_text())
    fields = {k.replace("-", "_"): v for k, v in keys.items() if k.replace("-", "_") in GPTConfig.model_fields}
    return GPTConfig(**{**fields, **extra})


def assert_preset_counts_as_published(preset: str, hf_config: Any, **extra: Any) -> tuple[GPTConfig, str]:
    """The parameter count of ``configs/<preset>`` (with ``extra``) equals transformers' own, of its model of
    ``hf_config`` (the published sizes) built on the meta device; returns our config and that model's class."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        theirs = AutoModelForCausalLM.from_config(hf_config)
    ours = preset_config(preset, **extra)
    assert num_parameters(ours) == sum(p.numel() for p in theirs.parameters())
    return ours, type(theirs).__name__
