"""Loading GPT-NeoX's checkpoints, before launch and in the inspect tool: ``neox_qkv_order`` is required
exactly where the files cannot say their grouped-query order and refused where it has nothing to say
(ConfigError naming the key, file:line); ``deepy-inspect-checkpoint`` reads what ``load:`` reads and
stops where ``load:`` stops; the ``args`` GPT-NeoX records are checked against the run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from neox_reference_layout import neox_files, write_neox_checkpoint

from megatron.checkpointing import discovery
from megatron.checkpointing.neox import recorded_mismatches
from megatron.config_rules import RuleContext
from megatron.checkpointing.neox.checks import neox_qkv_order_names_a_gpt_neox_checkpoint as rule
from megatron.errors import CheckpointError
from megatron.neox_arguments.arguments import NeoXArgs

MODEL = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=16)


def weights(kv_heads: int) -> dict[str, torch.Tensor]:
    """Full GPTModel-named tensors of a 2-layer llama-style model (random values: only names and shapes
    matter here)."""
    d, ffn = 16, 128
    out = {"embedding.word_embeddings.weight": torch.randn(256, 64), "final_norm.weight": torch.randn(64),
           "output_layer.weight": torch.randn(256, 64)}  # fmt: skip
    for i in range(2):
        out |= {f"layers.{i}.input_layernorm.weight": torch.randn(64),
                f"layers.{i}.post_attention_layernorm.weight": torch.randn(64),
                f"layers.{i}.attention.query_key_value.weight": torch.randn((4 + 2 * kv_heads) * d, 64),
                f"layers.{i}.attention.dense.weight": torch.randn(64, 64),
                f"layers.{i}.mlp.dense_h_to_4h.weight": torch.randn(2 * ffn, 64),
                f"layers.{i}.mlp.dense_4h_to_h.weight": torch.randn(64, ffn)}  # fmt: skip
    return out


def gpt_neox_save(tmp: Path, tag: str = "global_step7", kv_heads: int = 2) -> Path:
    files = neox_files(weights(kv_heads), num_layers=2, heads=4, kv_heads=kv_heads, tp=1, pipeline=False, llama=True)
    write_neox_checkpoint(tmp, tag, files, pipeline=False, tp=1, iteration=7)
    return tmp


def problems(**values: Any) -> list[str]:
    args = NeoXArgs(**MODEL, **values)
    return rule(RuleContext(args=args, provenance={k: f"cfg.yml:{i}" for i, k in enumerate(values, 1)}))


def test_a_grouped_query_gpt_neox_checkpoint_needs_the_order_before_launch(tmp_path: Path) -> None:
    save = gpt_neox_save(tmp_path / "neox")
    [message] = problems(num_kv_heads=2, load=str(save))
    assert "is a GPT-NeoX checkpoint" in message and "set neox_qkv_order: per_rank" in message
    assert problems(num_kv_heads=2, load=str(save), neox_qkv_order="per_rank") == []
    assert problems(num_kv_heads=2, initialize_from=str(save), neox_qkv_order="per_query_head") == []
    assert problems(num_kv_heads=4, load=str(save)) == []  # multi-head attention: one order in every era
    assert problems(num_kv_heads=2, load=str(save), load_checkpoint=False) == []


def test_the_order_is_refused_where_it_has_nothing_to_say(tmp_path: Path) -> None:
    [alone] = problems(num_kv_heads=2, neox_qkv_order="per_rank")
    assert "neox_qkv_order='per_rank' (cfg.yml:2) but nothing is loaded" in alone
    [empty] = problems(num_kv_heads=2, load=str(tmp_path), neox_qkv_order="per_rank")
    assert "holds no checkpoint yet" in empty
    deepy = tmp_path / "deepy" / "global_step3"
    deepy.mkdir(parents=True)
    args = {**MODEL, "num_kv_heads": 2}
    (deepy / "deepy_meta.json").write_text(json.dumps({"format": 2, "iteration": 3, "args": args}))
    (deepy / "COMMITTED").write_text(json.dumps({"step": 3, "kind": "step", "time": 0.0}))
    [against] = problems(num_kv_heads=2, load=str(deepy.parent), neox_qkv_order="per_rank")
    assert "format 2) whose grouped-query QKV rows are per_query_head: remove neox_qkv_order" in against
    assert problems(num_kv_heads=2, load=str(deepy.parent), neox_qkv_order="per_query_head") == []


def test_gpt_neox_recorded_args_must_match_the_run(tmp_path: Path) -> None:
    """GPT-NeoX's own load asserts its recorded args equal the run's; same-shape tensors would hide a
    different head count, so the recorded one is compared."""
    save = gpt_neox_save(tmp_path)
    state = torch.load(save / "global_step7" / "mp_rank_00_model_states.pt", weights_only=False)
    state["args"] = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 8, "model_parallel_size": 4}
    torch.save(state, save / "global_step7" / "mp_rank_00_model_states.pt")
    assert recorded_mismatches(save / "global_step7", {**MODEL}) == ["num_attention_heads: checkpoint 8, config 4"]


# --- deepy-inspect-checkpoint reads what load: reads ------------------------------------------------------
def inspect(path: Path) -> tuple[bool, str]:
    from tools.ckpts.inspect_checkpoint import describe, read

    try:
        return True, describe(read(path), show_config=True)
    except CheckpointError as err:
        return False, str(err)


def test_inspect_agrees_with_load_on_every_kind_of_directory(tmp_path: Path) -> None:
    """For each directory: ``load:`` reads a checkpoint from it (discovery: a committed Deepy one or a
    GPT-NeoX one) exactly when the inspect tool shows one, and then the same one; otherwise both stop
    with the same message."""
    from megatron.interop.deepy_checkpoint import write_weights_only_checkpoint
    from megatron.model.config import GPTConfig

    config = GPTConfig(**MODEL, max_position_embeddings=16, padded_vocab_size=256, norm="rmsnorm",
                       activation="swiglu", num_kv_heads=2, intermediate_size=128, mlp_multiple_of=128,
                       no_weight_tying=True, use_bias_in_attn_linear=False, use_bias_in_mlp=False)  # fmt: skip
    deepy = tmp_path / "deepy"
    write_weights_only_checkpoint(deepy, config=config, weights=weights(2), tp=1, pp=0, step=4, args={})
    cases = {
        "gpt-neox save dir": gpt_neox_save(tmp_path / "neox"),
        "gpt-neox tag": gpt_neox_save(tmp_path / "neox2") / "global_step7",
        "gpt-neox converter's tag 0": gpt_neox_save(tmp_path / "neox3", tag="0"),
        "deepy save dir": deepy,
        "empty": tmp_path / "empty",
        "missing": tmp_path / "missing",
    }
    (tmp_path / "empty").mkdir()
    for what, path in cases.items():
        found = discovery.inspect_load_dir(path)
        shown, text = inspect(path)
        assert shown == (found.kind in ("deepy", "gpt_neox")), (what, text)
        if not shown:
            assert text == discovery.explain(found, tp=1, pp=0), what
        elif found.kind == "gpt_neox":
            assert f"checkpoint        {found.foreign_tag}" in text and "load: reads it    yes" in text, what
            assert "iteration         7" in text and "layout            tp=1 plain" in text, what
            assert "GPT-NeoX's current names (mlp.linear1/linear2)" in text and "needs neox_qkv_order" in text
        else:
            assert "global_step4" in text and "rows per_rank (format 3)" in text and "resolved.yml" in text


# --- the offline converter (tools/ckpts/convert_hf_to_neox.py) on GPT-NeoX's Llama-style checkpoints ---------
LLAMA_CONFIG = {"num-layers": 2, "hidden-size": 64, "num-attention-heads": 4, "num-kv-heads": 2, "seq-length": 16,
                "max-position-embeddings": 16, "norm": "rmsnorm", "rms-norm-epsilon": 1.0e-6, "pos-emb": "rotary",
                "no-weight-tying": True, "use-bias-in-attn-linear": False, "use-bias-in-mlp": False,
                "tokenizer-type": "CharLevelTokenizer"}  # fmt: skip


@pytest.mark.parametrize("era", ["current", "mid2024"])
def test_the_offline_converter_reads_both_eras_of_a_grouped_query_llama(tmp_path: Path, era: str) -> None:
    """GPT-NeoX's current Llama config (activation: swiglu) and its mid-2024 one (mlp_type: llama with
    activation: silu, w1/w3/w2 files) convert to the source model; the QKV order is asked for."""
    from megatron.interop.hf_model import build_gpt_model
    from megatron.checkpointing.neox import read_neox_checkpoint

    full = weights(2)
    files = neox_files(full, num_layers=2, heads=4, kv_heads=2, tp=2, pipeline=era == "mid2024", llama=True, era=era)
    tag = write_neox_checkpoint(tmp_path / "neox", "global_step7", files, pipeline=era == "mid2024", tp=2, iteration=7)
    activation = {"activation": "swiglu"} if era == "current" else {"activation": "silu", "mlp-type": "llama"}
    (tag / "configs").mkdir()
    (tag / "configs" / "llama.yml").write_text(json.dumps({**LLAMA_CONFIG, **activation}))
    with pytest.raises(CheckpointError, match="set --neox-qkv-order: per_rank"):
        read_neox_checkpoint(tmp_path / "neox")
    order = "per_rank" if era == "current" else "per_query_head"
    neox = read_neox_checkpoint(tmp_path / "neox", qkv_order=order)
    assert neox.config.activation == "swiglu" and neox.config.ffn_hidden_size == 128 and neox.config.kv_heads == 2
    assert set(neox.weights) == set(full)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        delta = (build_gpt_model(neox.config, neox.weights)(tokens) - build_gpt_model(neox.config, full)(tokens))
    assert float(delta.abs().max()) <= 1e-5


def _llama_save(tmp: Path, finite: bool = True) -> tuple[Path, dict[str, torch.Tensor], Path]:
    """A GPT-NeoX Llama checkpoint (tp 1, plain) with 512 vocabulary rows (CharLevelTokenizer's), and its config
    as GPT-NeoX's Llama configs write it (``use_bias_in_norms: false``, configs/llama2/7B.yml:23 at ea7aefd8);
    not ``finite``: a NaN in the final norm's scale."""
    full = weights(2)
    full["embedding.word_embeddings.weight"] = torch.randn(512, 64)
    full["output_layer.weight"] = torch.randn(512, 64)
    if not finite:
        full["final_norm.weight"][5] = float("nan")
    files = neox_files(full, num_layers=2, heads=4, kv_heads=2, tp=1, pipeline=False, llama=True)
    write_neox_checkpoint(tmp / "neox", "global_step7", files, pipeline=False, tp=1, iteration=7)
    config = tmp / "llama.yml"
    config.write_text(json.dumps({**LLAMA_CONFIG, "activation": "swiglu", "use-bias-in-norms": False}))
    return tmp / "neox", full, config


def test_an_rmsnorm_checkpoint_with_gpt_neoxs_norm_bias_key_converts(tmp_path: Path) -> None:
    """``use_bias_in_norms: false`` (every GPT-NeoX Llama config) changes nothing in an RMSNorm (GPT-NeoX's get_norm
    hands RMSNorm only its epsilon: megatron/model/norms.py:19-59, transformer.py:931-934 at ea7aefd8), and
    deepy_model.yml leaves it out: the re-read check compares what changes the model, so the conversion succeeds,
    and the model deepy_model.yml describes, with the weights written, computes the source model's logits."""
    from megatron.interop.convert import import_to_deepy
    from megatron.interop.deepy_checkpoint import read_full_checkpoint
    from megatron.interop.hf_model import build_gpt_model
    from megatron.checkpointing.neox import read_neox_checkpoint
    from megatron.neox_arguments.loading import load_config

    source, full, config = _llama_save(tmp_path)
    report = import_to_deepy(source, tmp_path / "out", neox_configs=[config], neox_qkv_order="per_rank")
    assert report.config_file == tmp_path / "out" / "deepy_model.yml" and (report.checkpoint / "COMMITTED").is_file()
    written = load_config([str(report.config_file)], []).args
    assert written.norm == "rmsnorm" and written.load == str((tmp_path / "out").resolve())
    back = read_full_checkpoint(tmp_path / "out")
    neox = read_neox_checkpoint(source, [config], "per_rank")
    assert not neox.config.use_bias_in_norms and back.config.use_bias_in_norms  # the key the re-read differs in
    tokens = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours = build_gpt_model(written.with_vocab(512), back.weights)(tokens)
        theirs = build_gpt_model(neox.config, full)(tokens)
    assert float((ours - theirs).abs().max()) == 0.0
    # a key that does change the model still fails the check
    assert neox.config.differences(neox.config.replace(rms_norm_epsilon=1e-3)) == ["rms_norm_epsilon: 1e-06 -> 0.001"]
    assert neox.config.differences(back.config.replace(precision=neox.config.precision)) == []


@pytest.mark.parametrize("made_by_user", [False, True])
def test_a_failed_conversion_leaves_nothing_that_looks_finished(tmp_path: Path, made_by_user: bool) -> None:
    """A GPT-NeoX checkpoint whose weights are not finite fails the last check (its logits), after every file was
    written: the output directory is as before (absent, or the empty directory the user made, its mode kept),
    with no commit marker, deepy_model.yml or staging directory anywhere; a later conversion into it works."""
    from megatron.errors import ConversionError
    from megatron.interop.convert import import_to_deepy

    source, _, config = _llama_save(tmp_path, finite=False)
    out = tmp_path / "runs" / "imported"
    if made_by_user:
        out.mkdir(parents=True)
        out.chmod(0o750)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    with pytest.raises(ConversionError) as failed:
        import_to_deepy(source, out, neox_configs=[config], neox_qkv_order="per_rank")
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    assert "non-finite logits" in failed.value.message  # the last check, after every file was written
    if made_by_user:
        assert out.stat().st_mode & 0o777 == 0o750
    good, _, _ = _llama_save(tmp_path / "again")
    report = import_to_deepy(good, out, neox_configs=[config], neox_qkv_order="per_rank")
    assert (report.checkpoint / "COMMITTED").is_file() and report.config_file.is_file()
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["imported"]


# --- the engine's plain-model load reads the order a Deepy checkpoint's format records -----------------------
class PlainEngine:
    """What ``neox.files.install`` wraps on a plain DeepSpeed engine: ``load_checkpoint(load_dir, tag)``
    reading ``mp_rank_00_model_states.pt`` and handing it to ``load_module_state_dict`` (as DeepSpeed
    0.19.8 does; tests/unit/test_deepspeed_internals.py pins that on a real engine)."""

    def __init__(self) -> None:
        self.loaded: dict[str, torch.Tensor] = {}

    def module_state_dict(self) -> dict[str, torch.Tensor]:
        return {}

    def load_module_state_dict(self, checkpoint: dict[str, Any], *args: Any, **kwargs: Any) -> None:
        self.loaded = checkpoint["module"]

    def load_checkpoint(self, load_dir: str, tag: str, **kwargs: Any) -> tuple[str, dict[str, Any]]:
        state = torch.load(Path(load_dir) / tag / "mp_rank_00_model_states.pt", weights_only=False)
        self.load_module_state_dict(state)
        return load_dir, {}


@pytest.mark.parametrize(("era", "fmt"), [("mid2024", 2), ("current", 3), ("current", None)])
def test_the_engine_reads_a_deepy_checkpoints_recorded_order(tmp_path: Path, era: str, fmt: int | None) -> None:
    """Format 2 (GPT-NeoX's mid-2024 layout, grouped by query head) and 3 (current, per rank) load as
    the model they hold; files that record no format are refused for a grouped-query model."""
    from megatron.checkpointing.neox import install
    from megatron.model.config import GPTConfig

    config = GPTConfig(**MODEL, max_position_embeddings=16, padded_vocab_size=256, norm="rmsnorm",
                       activation="swiglu", num_kv_heads=2, intermediate_size=128, mlp_multiple_of=128,
                       no_weight_tying=True, use_bias_in_attn_linear=False, use_bias_in_mlp=False)  # fmt: skip
    full = weights(2)
    files = neox_files(full, num_layers=2, heads=4, kv_heads=2, tp=1, pipeline=False, llama=True, era=era)
    tag = write_neox_checkpoint(tmp_path, "global_step3", files, pipeline=False, tp=1, iteration=3)
    if fmt is not None:  # a weights-only checkpoint of an earlier Deepy: the format only in deepy_meta.json
        (tag / "deepy_meta.json").write_text(json.dumps({"format": fmt}))
    engine = PlainEngine()
    install(engine, config, tp=1)
    if fmt is None:
        with pytest.raises(CheckpointError, match="records no Deepy format"):
            engine.load_checkpoint(str(tmp_path), "global_step3")
        return
    engine.load_checkpoint(str(tmp_path), "global_step3")
    assert set(engine.loaded) == set(full) and all(torch.equal(engine.loaded[k], full[k]) for k in full)
