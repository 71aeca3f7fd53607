"""LoRA adapters in one process: what they add, what they freeze, how they merge, and the config
rules that refuse adapter keys that would be ignored."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_config_rules import ok, problems

from megatron.model import GPTConfig, GPTModel
from megatron.model.lora import adapters_disabled, apply_lora, merge_adapters
from megatron.model.lora_config import LoRAArgs

TARGETS = ("query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h")
CONFIG = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=8, padded_vocab_size=64)


def adapted(config: GPTConfig = CONFIG, **lora: object) -> tuple[GPTModel, dict[str, torch.Tensor]]:
    model = GPTModel(config)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    apply_lora(model, LoRAArgs(**{"lora_r": 4, "lora_alpha": 8.0, "lora_target_modules": list(TARGETS), **lora}), seed=7)  # type: ignore[arg-type]
    return model, before


def test_fresh_adapters_leave_the_model_unchanged_and_only_they_train() -> None:
    model, before = adapted()
    tokens = torch.randint(0, 64, (2, 8))
    base = GPTModel(CONFIG)
    torch.testing.assert_close(model(tokens), base(tokens), rtol=0, atol=0)  # B starts at zero
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {f"layers.{i}.{block}.{t}.adapter.lora_{f}" for i in range(2) for f in "AB"
                         for block, t in (("attention", "query_key_value"), ("attention", "dense"),
                                          ("mlp", "dense_h_to_4h"), ("mlp", "dense_4h_to_h"))}
    model(tokens).sum().backward()
    assert all(p.grad is None for n, p in model.named_parameters() if n not in trainable)
    assert {k: v for k, v in model.state_dict().items() if ".adapter." not in k}.keys() == before.keys()


def test_adapter_term_is_scale_times_b_a_x_and_merges_into_the_weight() -> None:
    """Direct computation: the adapted qkv output is W x + b + alpha/r B A x; merged weights give the
    adapted model's logits in a plain model."""
    model, _ = adapted(lora_alpha=6.0)
    for p in model.parameters():
        if p.requires_grad:
            p.data.normal_(0, 0.3)
    layer = model.layers[0].attention.query_key_value
    x = torch.randn(3, 32)
    want = x @ layer.weight.T + layer.bias + (6.0 / 4) * (x @ layer.adapter.lora_A.T @ layer.adapter.lora_B.T)
    torch.testing.assert_close(layer(x), want)
    tokens = torch.randint(0, 64, (2, 8))
    plain = GPTModel(CONFIG)
    plain.load_state_dict(merge_adapters(model.state_dict(), 6.0 / 4))
    torch.testing.assert_close(plain(tokens), model(tokens), atol=1e-5, rtol=1e-5)
    with adapters_disabled(model):  # the base alone: the reference model of DPO/KTO
        torch.testing.assert_close(model(tokens), GPTModel(CONFIG)(tokens), rtol=0, atol=0)
    assert not torch.equal(model(tokens), GPTModel(CONFIG)(tokens))


def test_target_modules_choose_the_layers_and_a_reward_head_trains() -> None:
    model, _ = adapted(CONFIG.replace(value_head=True), lora_target_modules=["dense"])
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    # the scalar head is new (no base to keep), so it trains beside the attention-output adapters
    assert trainable == {"value_head.weight", *(f"layers.{i}.attention.dense.adapter.lora_{f}"
                                                for i in range(2) for f in "AB")}


def test_lora_keys_are_read_into_the_run_config() -> None:
    from megatron.neox_arguments.run_config import RunConfig

    args = ok(lora_r=8, lora_alpha=16, lora_dropout=0.1, lora_target_modules=["dense", "dense_4h_to_h"]).args
    lora = RunConfig.from_args(args).lora
    assert (lora.lora_r, lora.lora_alpha, lora.lora_dropout, lora.lora_target_modules) == (8, 16.0, 0.1, ["dense", "dense_4h_to_h"])
    assert lora.lora_scale == 2.0 and lora.lora_enabled


def test_adapter_keys_without_a_rank_are_refused() -> None:
    message = problems(lora_alpha=32, lora_target_modules=["dense"])
    assert "lora_alpha=32" in message and "lora_target_modules" in message and "lora_r=0" in message


def test_mlp_adapters_on_moe_layers_are_refused() -> None:
    message = problems(lora_r=4, lora_target_modules=["dense_h_to_4h"], moe_num_experts=2)
    assert "lora_target_modules" in message and "moe_num_experts=2" in message
    ok(lora_r=4, lora_target_modules=["query_key_value"], moe_num_experts=2)


def test_unknown_target_module_is_refused() -> None:
    from megatron.errors import ConfigError
    from megatron.neox_arguments.loading import config_from_mapping

    with pytest.raises(ConfigError, match="lora_target_modules") as err:  # the loader's structure check
        config_from_mapping({"lora_r": 4, "lora_target_modules": ["q_proj"]})
    assert "query_key_value" in err.value.message  # it lists what is accepted


def test_a_checkpoint_without_adapters_loads_as_a_base_only() -> None:
    """initialize_from/finetune: strict load with the adapters detached; resuming it is refused with the fix."""
    from pathlib import Path
    from types import SimpleNamespace

    from megatron.checkpointing.new_parameters import base_checkpoint_loading
    from megatron.errors import CheckpointError

    model, before = adapted()
    engine = SimpleNamespace(module=model)
    base_state = GPTModel(CONFIG).state_dict()
    with base_checkpoint_loading(engine, Path("ck/global_step2"), {"lora_r": 0}, {"lora_r": 4}, weights_only=True):
        model.load_state_dict(base_state, strict=True)  # no adapter entries expected inside
    assert any(".adapter.lora_A" in k for k in model.state_dict())  # attached again afterwards
    with pytest.raises(CheckpointError, match="initialize_from: ck"):
        base_checkpoint_loading(engine, Path("ck/global_step2"), {"lora_r": 0}, {"lora_r": 4}, weights_only=False)
    # a run's own adapter checkpoints, and runs without adapters, load as before
    with base_checkpoint_loading(engine, Path("ck/global_step2"), {"lora_r": 4}, {"lora_r": 4}, weights_only=False):
        with pytest.raises(RuntimeError, match="adapter"):
            model.load_state_dict(base_state, strict=True)


def test_lora_dropout_drops_adapter_inputs_while_training_only() -> None:
    model, _ = adapted(lora_dropout=0.5)
    for p in model.parameters():
        if p.requires_grad:
            p.data.normal_(0, 0.3)
    layer = model.layers[0].mlp.dense_4h_to_h
    x = torch.randn(4, 128)
    torch.manual_seed(0)
    layer.train()
    trained = layer(x) - F.linear(x, layer.weight, layer.bias)
    layer.eval()
    full = layer(x) - F.linear(x, layer.weight, layer.bias)
    torch.testing.assert_close(full, (8.0 / 4) * (x @ layer.adapter.lora_A.T @ layer.adapter.lora_B.T))
    assert not torch.allclose(trained, full)  # some inputs were dropped (and the rest scaled by 2)


def test_full_weights_from_a_lora_checkpoint_are_refused_before_launch(tmp_path, capsys) -> None:
    """Issue 30 item 6: full-parameter training from a LoRA checkpoint died on every rank with "Unexpected key(s)"
    and no way to merge; now one message names lora_r and initialize_from and the way to merge."""
    import json
    from pathlib import Path

    from megatron.app.deepy import main
    from megatron.checkpointing.commit import CommitInfo, write_commit_marker
    from megatron.errors import run_guarded

    ckpt = tmp_path / "sft_lora" / "global_step7"
    ckpt.mkdir(parents=True)
    (ckpt / "deepy_meta.json").write_text(json.dumps({"format": 2, "iteration": 7, "args": {
        "lora_r": 8, "lora_alpha": 16.0, "lora_target_modules": ["query_key_value"]}}))
    write_commit_marker(ckpt, CommitInfo(7, "step", 0.0))
    config = tmp_path / "run.yml"
    config.write_text("num_layers: 2\nhidden_size: 64\nnum_attention_heads: 4\nseq_length: 32\ntrain_iters: 2\n"
                      "lr: 0.001\ntrain_micro_batch_size_per_gpu: 2\nnum_gpus: 1\ntokenizer_type: CharLevelTokenizer\n"
                      f"use_dummy_dataset: true\ninitialize_from: {ckpt.parent}\n")
    argv = ["--dry-run", str(Path(__file__).resolve().parents[2] / "train.py"), str(config)]

    def dry_run(*extra: str) -> tuple[int, str]:
        with pytest.raises(SystemExit) as done:
            run_guarded(lambda: main([*argv, *extra]), argv=argv)
        out = capsys.readouterr()
        return int(done.value.code or 0), out.out + out.err

    code, out = dry_run()
    assert code == 2 and "Traceback" not in out, out
    assert f"initialize_from='{ckpt.parent}' ({config}:11): global_step7 holds LoRA adapters (lora_r 8" in out, out
    assert "lora_r=0 (default)" in out and "set lora_r: 8" in out and "convert_neox_to_hf.py" in out, out
    assert dry_run("lora_r=8", "lora_alpha=16.0")[0] == 0  # going on with its adapters is fine


# ------------------------------------------------------------------- Levanter's LoRA on every linear layer
LLAMA = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_kv_heads=2, seq_length=8,
                  padded_vocab_size=64, norm="rmsnorm", activation="swiglu", intermediate_size=48,
                  no_weight_tying=True, pos_emb="rotary", use_bias_in_attn_linear=False, use_bias_in_mlp=False)
EVERY = ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h", "output_layer"]


def test_split_adapters_are_separate_low_rank_updates_per_section_and_the_head_is_adapted() -> None:
    """lora_split_fused: q, k, v (GQA: k and v narrower) and gate, up each get their own A_s [r, in], B_s [out_s, r]
    (Levanter's LowRankLinear per hnn.Linear, lora.py:118-157@9263f81e); the section's rows are computed by hand
    here. The head's adapter adds scale * B A h to the logits of the final norm's output h. Merging gives the
    adapted model's logits in a plain model."""
    model, _ = adapted(LLAMA, lora_target_modules=EVERY, lora_split_fused=True, lora_alpha=6.0)
    gen = torch.Generator().manual_seed(0)
    for p in model.parameters():
        if p.requires_grad:
            p.data = torch.randn(p.shape, generator=gen) * 0.3
    scale, r, x = 6.0 / 4, 4, torch.randn(3, 32, generator=gen)
    for layer, sizes in ((model.layers[0].attention.query_key_value, [32, 16, 16]),
                         (model.layers[1].mlp.dense_h_to_4h, [LLAMA.ffn_hidden_size] * 2)):
        a, b = layer.adapter.lora_A, layer.adapter.lora_B
        assert a.shape == (len(sizes) * r, 32) and b.shape == (sum(sizes), r)
        rows = []
        for s, (a_s, b_s) in enumerate(zip(a.split(r), b.split(sizes))):
            rows.append(scale * (x @ a_s.T) @ b_s.T)  # section s alone: its own rank-r update
        torch.testing.assert_close(layer(x), x @ layer.weight.T + torch.cat(rows, dim=1))
    tokens = torch.randint(0, 64, (2, 8), generator=gen)
    hidden = {}
    model.final_norm.register_forward_hook(lambda m, i, o: hidden.setdefault("h", o))
    logits = model(tokens)
    head, h = model.output_layer, hidden["h"].transpose(0, 1)  # [b, s, hidden]
    want = h @ head.weight.T + scale * (h @ head.adapter.lora_A.T) @ head.adapter.lora_B.T
    torch.testing.assert_close(logits, want, atol=1e-5, rtol=1e-5)
    from megatron.interop.lora_export import fused_sections

    plain = GPTModel(LLAMA)
    plain.load_state_dict(merge_adapters(model.state_dict(), scale, fused_sections(LLAMA)))
    torch.testing.assert_close(plain(tokens), logits, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="split by sections"):
        merge_adapters(model.state_dict(), scale)  # a split adapter needs its sections


def test_levanter_init_draws_both_factors_from_a_truncated_normal() -> None:
    """haliax@f41e7d40 linear.py:41-69: truncated_normal(-3, 3) * 1/sqrt(fan_in) for A (fan in: the layer's input)
    and B (fan in: r) alike (lora.py:148-152@9263f81e), so a fresh Levanter LoRA model is not the base. The std of
    a standard normal truncated at +-3 is 0.98658."""
    config = LLAMA.replace(hidden_size=256, num_attention_heads=4, num_kv_heads=4, intermediate_size=256,
                           num_layers=1, padded_vocab_size=512)
    model, _ = adapted(config, lora_target_modules=EVERY, lora_split_fused=True, lora_init="levanter", lora_r=64)
    layer = model.layers[0].attention.query_key_value.adapter
    for t, fan_in in ((layer.lora_A, 256), (layer.lora_B, 64), (model.output_layer.adapter.lora_B, 64)):
        values = t.detach().flatten() * fan_in ** 0.5
        assert values.abs().max() <= 3.0 + 1e-5 and values.abs().max() > 2.5
        assert abs(values.std().item() - 0.98658) < 0.02 and abs(values.mean().item()) < 0.02
    tokens = torch.randint(0, 512, (1, 8))
    assert not torch.allclose(model(tokens), GPTModel(config)(tokens))  # B is not zero (PEFT's is: first test)


def test_head_and_levanter_init_rules() -> None:
    message = problems(lora_r=4, lora_target_modules=["output_layer"])  # tied by default
    assert "lora_target_modules" in message and "no_weight_tying" in message and "tied" in message
    ok(lora_r=4, lora_target_modules=["output_layer"], no_weight_tying=True)
    message = problems(lora_r=4, lora_init="levanter", train_impl="dpo", no_weight_tying=True)
    assert "lora_init='levanter'" in message and "train_impl='dpo'" in message
    assert "lora_split_fused" in problems(lora_split_fused=True)  # without a rank


def test_split_and_head_adapters_reshard_as_they_are_split() -> None:
    """A checkpoint's tp change (universal checkpoint, generation's vocabulary fit) splits each tensor by
    ``tp_partition_of``: it must describe what the adapters themselves record (their tp attributes, which the
    2-rank check in tests/distributed/test_lora_tp.py validates): A of a split adapter ([S r, in]) replicated, B by
    the layer's sections, the head's B by vocabulary rows (padding kept)."""
    from megatron.model.partitioning import tp_partition_of
    from megatron.mpu.initialize_weights import tensor_parallel_partition

    model, _ = adapted(LLAMA, lora_target_modules=EVERY, lora_split_fused=True)
    checked = 0
    for name, param in model.named_parameters():
        if ".adapter." not in name and not name.startswith("output_layer.adapter"):
            continue
        dim, sections = tensor_parallel_partition(param)
        table = tp_partition_of(LLAMA, name)
        if dim == -1:
            assert table is None, name
        else:
            assert table is not None and table.dim == dim, name
            assert list(table.sections or [param.shape[dim]]) == list(sections or [param.shape[dim]]), name
            assert table.vocabulary == name.startswith("output_layer"), name
        checked += 1
    assert checked == 2 * (4 * 2 + 1)


def test_split_adapters_drop_their_inputs_each_on_their_own() -> None:
    """Separate modules draw separate dropout masks (Levanter's LowRankLinear each has its hnn.Dropout)."""
    model, _ = adapted(LLAMA, lora_target_modules=["query_key_value"], lora_split_fused=True, lora_dropout=0.5)
    layer = model.layers[0].attention.query_key_value
    with torch.no_grad():
        layer.adapter.lora_A.copy_(torch.eye(4, 32).repeat(3, 1))  # every section reads the same 4 inputs
        layer.adapter.lora_B.fill_(1.0)
    layer.train()
    torch.manual_seed(0)
    term = layer(torch.ones(64, 32)) - F.linear(torch.ones(64, 32), layer.weight)  # [64, q + k + v]
    q, k, v = term.split([32, 16, 16], dim=1)
    assert not torch.equal(q[:, 0], k[:, 0]) and not torch.equal(k[:, 0], v[:, 0])  # masks differ per section

