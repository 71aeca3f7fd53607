"""muP (use_mup and its keys, megatron/model/mup.py and mup_shapes.py): the model's init and multipliers against
GPT-NeoX ea7aefd8's formulas re-derived here, the optimizer's learning rates against mup 1.0.0's MuAdam/MuSGD rules
written out here, the base shapes file against mup's YAML format written by hand, and the coordinate check: flat
activations across widths under muP, growing ones without. (Deepy does not install mup: it requires torchvision.)"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml

from megatron.config_rules import Device
from megatron.errors import ConfigError
from megatron.model import GPTConfig, GPTModel
from megatron.model.mup import apply_base_shapes, mup_param_groups
from megatron.model.mup_shapes import zip_infshape
from megatron.training.mup_actions import write_base_shapes
from megatron.neox_arguments import config_from_mapping
from megatron.neox_arguments.derived import finalize

BASE = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=8, max_position_embeddings=8,
            padded_vocab_size=64, seed=3, pos_emb="learned", precision="fp32", hidden_dropout=0.0,
            attention_dropout=0.0)
WIDE = 128  # width multiplier 4 over the base shapes' 32
LAUNCH = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=8, train_iters=4, lr=1e-3,
              train_micro_batch_size_per_gpu=2, use_dummy_dataset=True, tokenizer_type="CharLevelTokenizer",
              pipe_parallel_size=0)
DEVICE = Device(cuda=False, fp16_supported=False)


@pytest.fixture(scope="module")
def shapes(tmp_path_factory: pytest.TempPathFactory) -> str:
    """save_base_shapes' file for BASE (mup_width_scale 2: the delta model is 64 wide)."""
    path = str(tmp_path_factory.mktemp("mup") / "base.bsh")
    write_base_shapes(GPTConfig(**BASE, use_mup=True, base_shapes_file=path, mup_width_scale=2), path)
    return path


def _pair(path: str, **mup_keys: Any) -> tuple[GPTModel, GPTModel, GPTConfig]:
    """The WIDE model with muP (base shapes applied) and without, from the same seed."""
    config = GPTConfig(**{**BASE, "hidden_size": WIDE}, use_mup=True, base_shapes_file=path, **mup_keys)
    mu = GPTModel(config)
    apply_base_shapes(mu, config)
    sp = GPTModel(config.replace(use_mup=False))
    return mu, sp, config


MUP_HEADER = """\
# This is a base shape file encoded in yaml
# - `null` indicates a dimension is "finite", i.e. a non-"width" dimension
# - a number indicates the base dimension of an "infinite" dimension, i.e. some notion of "width"
"""
"""mup 1.0.0 shape.py's __BSH_COMMENT__, copied by hand."""


def expected_base_shapes(untied: bool = False) -> dict[str, list[int | None]]:
    """BASE's base shapes worked out by hand: against a 64-wide delta model every dimension of size hidden (32),
    3 x hidden (96) or 4 x hidden (128) is a width at its base size; the vocabulary (64) and positions (8) are not."""
    h = 32
    shapes: dict[str, list[int | None]] = {"embedding.word_embeddings.weight": [None, h],
                                           "embedding.position_embeddings.weight": [None, h],
                                           "final_norm.weight": [h], "final_norm.bias": [h]}
    for i in range(2):
        layer = f"layers.{i}"
        shapes.update({
            f"{layer}.input_layernorm.weight": [h], f"{layer}.input_layernorm.bias": [h],
            f"{layer}.attention.query_key_value.weight": [3 * h, h], f"{layer}.attention.query_key_value.bias": [3 * h],
            f"{layer}.attention.dense.weight": [h, h], f"{layer}.attention.dense.bias": [h],
            f"{layer}.post_attention_layernorm.weight": [h], f"{layer}.post_attention_layernorm.bias": [h],
            f"{layer}.mlp.dense_h_to_4h.weight": [4 * h, h], f"{layer}.mlp.dense_h_to_4h.bias": [4 * h],
            f"{layer}.mlp.dense_4h_to_h.weight": [h, 4 * h], f"{layer}.mlp.dense_4h_to_h.bias": [h]})
    if untied:
        shapes["output_layer.weight"] = [None, h]
    return shapes


def test_save_base_shapes_writes_mups_file(shapes: str) -> None:
    """The file is byte for byte what mup 1.0.0's save_base_shapes writes for these base shapes (its header, then
    yaml.dump(..., indent=4)); hidden dimensions are widths based at 32 (mup_width_scale told them apart), the
    vocabulary and positions are not. Read back on a 4x wider model: two-width matrices have multiplier 4."""
    expected = expected_base_shapes()
    text = Path(shapes).read_text()
    assert text == MUP_HEADER + yaml.dump(expected, None, indent=4)
    assert yaml.safe_load(text) == expected
    config = GPTConfig(**{**BASE, "hidden_size": WIDE}, use_mup=True, base_shapes_file=shapes)
    model = GPTModel(config)
    apply_base_shapes(model, config)
    assert model.layers[1].mlp.dense_4h_to_h.weight.infshape.width_mult() == 4.0
    assert model.layers[1].mlp.dense_4h_to_h.weight.infshape.ninf() == 2
    assert model.embedding.word_embeddings.weight.infshape.ninf() == 1
    assert model.final_norm.weight.infshape.ninf() == 1


def test_init_is_gpt_neoxs_mup_init(shapes: str) -> None:
    """GPT-NeoX re-draws each tensor-parallel layer's weight with mup.init.normal_(std) * mup_init_scale: std over
    sqrt(width_mult) when both dimensions are widths, std when one is; norms and positions keep their init."""
    mu, sp, _ = _pair(shapes, mup_init_scale=0.5)
    wm = WIDE / 32
    mu_params, sp_params = dict(mu.named_parameters()), dict(sp.named_parameters())
    for name, p in mu_params.items():
        q = sp_params[name]
        if name.endswith(("query_key_value.weight", "dense.weight", "dense_h_to_4h.weight", "dense_4h_to_h.weight")):
            torch.testing.assert_close(p, q * 0.5 / math.sqrt(wm), msg=name)  # two width dims
        elif name == "embedding.word_embeddings.weight":
            torch.testing.assert_close(p, q * 0.5, msg=name)  # vocab x width: one width dim
        else:  # norms, biases, learned positions (GPT-NeoX's nn.Embedding is not re-drawn)
            torch.testing.assert_close(p, q, msg=name)
    # and the std is mup's init.normal_(std=0.02) for a two-width weight (std / sqrt(width_mult)), times the scale
    w = mu.layers[0].mlp.dense_h_to_4h.weight
    assert float(w.detach().std()) == pytest.approx(0.02 / math.sqrt(wm) * 0.5, rel=0.05)


def test_attention_scores_are_divided_by_head_dim_and_temperature(shapes: str) -> None:
    """GPT-NeoX's norm_factor = head_dim under use_mup (1/d, not 1/sqrt(d)); mup_attn_temp divides further."""
    mu, _, config = _pair(shapes, mup_attn_temp=2.0)
    attn = mu.layers[0].attention
    x = torch.randn(8, 2, WIDE, generator=torch.Generator().manual_seed(0))  # [s, b, h]
    heads, d = config.arch.heads, WIDE // config.arch.heads
    qkv = F.linear(x, attn.query_key_value.weight, attn.query_key_value.bias)  # [s, b, 3h]
    q, k, v = (t.reshape(8, 2, heads, d).permute(1, 2, 0, 3) for t in qkv.split(WIDE, dim=-1))  # [b, n, s, d]
    scores = q @ k.transpose(-1, -2) / d / 2.0
    scores = scores.masked_fill(torch.ones(8, 8, dtype=torch.bool).triu(1), float("-inf"))
    out = (scores.softmax(-1) @ v).permute(2, 0, 1, 3).reshape(8, 2, WIDE)
    expected = F.linear(out, attn.dense.weight, attn.dense.bias)
    torch.testing.assert_close(attn(x), expected)


@pytest.mark.parametrize("untied", [False, True])
def test_logits_are_divided_by_width_mult_and_output_temp(shapes: str, untied: bool) -> None:
    """GPT-NeoX's _logits_helper (tied) and ColumnParallelLinear's mup_rescale_parameters (untied) divide the last
    hidden state by the width multiplier (hidden / base hidden); mup_output_temp divides the logits further."""
    path = shapes
    if untied:  # another model: its own base shapes
        path = str(Path(shapes).with_name("untied.bsh"))
        write_base_shapes(GPTConfig(**BASE, no_weight_tying=True, use_mup=True, base_shapes_file=path), path)
        assert yaml.safe_load(Path(path).read_text()) == expected_base_shapes(untied=True)
    mu, _, _ = _pair(path, mup_output_temp=3.0, no_weight_tying=untied)
    seen: dict[str, torch.Tensor] = {}
    mu.final_norm.register_forward_hook(lambda m, i, o: seen.update(h=o))
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    logits = mu(tokens)
    expected = seen["h"].transpose(0, 1) @ mu.output_weight().t() / ((WIDE / 32) * 3.0)
    torch.testing.assert_close(logits, expected)


def test_embedding_multipliers_are_gpt_neoxs(shapes: str) -> None:
    """GPT-NeoX's Embedding: positions times mup_rp_embedding_mult, then (use_mup) the sum times mup_embedding_mult
    in place under torch.no_grad, so the gradient does not carry the factor. Its code, run here on our weights."""
    mu, _, _ = _pair(shapes, mup_embedding_mult=3.0, mup_rp_embedding_mult=0.5)
    emb = mu.embedding
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(2))
    weight = emb.word_embeddings.weight.detach().clone().requires_grad_(True)
    # GPT-NeoX ea7aefd8 megatron/model/word_embeddings.py Embedding.forward, batch-first
    words = F.embedding(tokens, weight)
    positions = emb.position_embeddings.weight[torch.arange(8)].detach()
    positions = positions.clone().mul_(0.5)
    embeddings = words + positions
    with torch.no_grad():
        embeddings.mul_(3.0)
    ours = emb(tokens)  # [s, b, h]
    torch.testing.assert_close(ours, embeddings.transpose(0, 1))
    grad = torch.randn_like(ours)
    ours.backward(grad)
    embeddings.backward(grad.transpose(0, 1))
    torch.testing.assert_close(emb.word_embeddings.weight.grad, weight.grad)


def test_sp_model_multiplies_positions_with_rp_mult_too(shapes: str) -> None:
    """GPT-NeoX applies mup_rp_embedding_mult whether or not use_mup is set."""
    config = GPTConfig(**BASE, mup_rp_embedding_mult=2.0)
    model, plain = GPTModel(config), GPTModel(config.replace(mup_rp_embedding_mult=1.0))
    tokens = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(3))
    pos = model.embedding.position_embeddings.weight[:8].unsqueeze(1)  # [s, 1, h]
    torch.testing.assert_close(model.embedding(tokens), plain.embedding(tokens) + pos)


@pytest.fixture()
def one_rank() -> Any:
    from single_rank import init_single_rank_gloo

    from megatron import mpu

    init_single_rank_gloo()
    mpu.initialize_model_parallel(1, 0)
    yield
    mpu.destroy_model_parallel()


def test_engine_learning_rates_are_mups_muadam(one_rank: Any, shapes: str) -> None:
    """build_engine (real DeepSpeed engine, Deepy's schedule) with use_mup: every parameter's learning rate and weight
    decay are mup 1.0.0's MuAdam's, written out here from the hand-written base shapes (a parameter with two width
    dimensions: lr / fan-in multiplier, weight_decay x it; any other: unchanged), at every step of the schedule
    (GPT-NeoX's AnnealingLR would reset them: docs/mup.md)."""
    from megatron.engine.build import build_engine
    from megatron.neox_arguments.run_config import RunConfig

    keys = dict(hidden_size=WIDE, use_mup=True, base_shapes_file=shapes, pos_emb="learned", weight_decay=0.1,
                warmup=0.0, lr_decay_style="constant", lr=1e-3)
    run = RunConfig.from_resolved(finalize(config_from_mapping({**LAUNCH, **keys}), 1, device=DEVICE))
    eng = build_engine(run, run.model.with_vocab(64), 4)
    base = expected_base_shapes()
    want = {}
    for name, p in eng.engine.module.named_parameters():
        decay = 0.0 if "norm" in name or name.endswith("bias") else 0.1
        widths = [(b, d) for b, d in zip(base[name], p.shape) if b is not None]
        mult = widths[-1][1] / widths[-1][0] if len(widths) == 2 else 1.0
        want[id(p)] = (1e-3 / mult, decay * mult)
    assert sorted({lr for lr, _ in want.values()}) == [1e-3 / 4, 1e-3]
    for _ in range(2):
        got = {id(p): (g["lr"], g["weight_decay"]) for g in eng.optimizer.param_groups for p in g["params"]}
        assert got.keys() == want.keys()
        for key, (lr, wd) in want.items():
            assert got[key] == (pytest.approx(lr), pytest.approx(wd))
        eng.lr_scheduler.step()


@pytest.mark.parametrize("kind", ["adam", "sgd"])
def test_param_groups_follow_mups_muadam_and_musgd(kind: str) -> None:
    """mup 1.0.0 optim.py's rules, written out per parameter: MuAdam divides a matrix-like parameter's lr by its
    fan-in multiplier (and multiplies its weight decay by it); MuSGD multiplies a vector-like parameter's lr by its
    multiplier (weight decay divided) and divides a matrix-like one's by fan-in over fan-out multiplier (weight
    decay multiplied); finite parameters keep the group's values."""
    def param(base: list[int | None], shape: list[int]) -> torch.nn.Parameter:
        p = torch.nn.Parameter(torch.zeros(shape))
        p.infshape = zip_infshape(base, shape)  # type: ignore[attr-defined]
        return p

    matrix = param([32, 32], [128, 256])  # fan-out x4, fan-in x8
    square = param([32, 32], [96, 96])  # x3 both
    column = param([16, None], [64, 10])  # one width, x4
    row = param([None, 16], [10, 48])  # one width, x3
    finite = param([None], [10])
    lr, wd = 0.1, 0.5
    groups = mup_param_groups([{"params": [matrix, square, column], "weight_decay": wd},
                               {"params": [row, finite], "weight_decay": 0.0}], kind, lr)
    got = {id(p): (g["lr"], g["weight_decay"], g["lr_scale"]) for g in groups for p in g["params"]}
    if kind == "adam":
        want = {matrix: (lr / 8, wd * 8), square: (lr / 3, wd * 3), column: (lr, wd), row: (lr, 0.0),
                finite: (lr, 0.0)}
    else:
        want = {matrix: (lr / 2, wd * 2), square: (lr, wd), column: (lr * 4, wd / 4), row: (lr * 3, 0.0),
                finite: (lr, 0.0)}
    assert got.keys() == {id(p) for p in want}
    for p, (p_lr, p_wd) in want.items():
        assert got[id(p)] == (pytest.approx(p_lr), pytest.approx(p_wd), pytest.approx(p_lr / lr))
    assert all(g["params"] for g in groups)


def _refused(**keys: Any) -> str:
    with pytest.raises(ConfigError) as info:
        finalize(config_from_mapping({**LAUNCH, **keys}), 1, device=DEVICE)
    return info.value.message


def test_refused_before_launch(shapes: str) -> None:
    assert "needs base_shapes_file" in _refused(use_mup=True)
    assert "no such file" in _refused(use_mup=True, base_shapes_file="/nonexistent/base.bsh")
    assert "only with use_mup" in _refused(coord_check=True)
    assert "only with use_mup" in _refused(save_base_shapes=True, mup_width_scale=4)
    assert "Adam and SGD only" in _refused(use_mup=True, base_shapes_file=shapes, optimizer_type="lion")
    assert "cannot either" in _refused(use_mup=True, base_shapes_file=shapes, init_method="orthogonal")
    assert "stage 3" in _refused(use_mup=True, base_shapes_file=shapes, zero_optimization={"stage": 3})
    assert "LoRA" in _refused(use_mup=True, base_shapes_file=shapes, lora_r=2)
    assert "l / head_dim" in _refused(use_mup=True, base_shapes_file=shapes, apply_query_key_layer_scaling=True)
    assert "reward head" in _refused(use_mup=True, base_shapes_file=shapes, train_impl="dpo")
    resolved = finalize(config_from_mapping({**LAUNCH, "use_mup": True, "base_shapes_file": shapes,
                                             "init_method": "small_init"}), 1, device=DEVICE)
    assert any("init_method='small_init'" in w and "shrinks with hidden_size" in w for w in resolved.warnings)


def test_coord_check_is_flat_under_mup_and_grows_without(shapes: str, tmp_path: Path) -> None:
    """Our coordinate check (mup's get_coord_data ported, widths 64..512, two blocks, three Adam steps): each record is
    the l1 of a module's output (checked directly at init); after two updates
    the slope of log l1 against log width is about 0 under muP for the logits and each block, and clearly positive
    under the standard parametrisation (GPT-NeoX's fixed-std init and one lr for every width)."""
    from megatron.objectives import ObjectiveArgs, build_objective
    from megatron.training.mup_actions import coord_check, coord_check_batches, run_mup_action

    path = str(tmp_path / "cc.bsh")
    config = GPTConfig(**{**BASE, "hidden_size": 64, "seq_length": 16, "max_position_embeddings": 16},
                       use_mup=True, base_shapes_file=path, save_base_shapes=True)
    assert "wrote the muP base shapes" in run_mup_action(config, str(tmp_path), list, "adam", 1e-2,
                                                         torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    samples = [{"text": torch.randint(0, 64, (17,), generator=gen).numpy()} for _ in range(12)]
    batches = coord_check_batches(samples, 4, 3, build_objective(ObjectiveArgs()).prepare)
    assert [tuple(x.shape) + tuple(y.shape) for x, y in batches] == [(4, 16, 64)] * 3
    torch.testing.assert_close(batches[1][0][0], torch.as_tensor(samples[4]["text"][:-1]).long())
    config = config.replace(save_base_shapes=False, coord_check=True)
    records = coord_check(config, batches, "adam", 1e-2, str(tmp_path), widths=[64, 128, 256, 512])
    assert (tmp_path / "coord_check_up.png").stat().st_size > 10_000
    assert (tmp_path / "coord_check_sp.png").stat().st_size > 10_000

    def l1(tag: str, module: str, t: int) -> dict[int, float]:
        return {r.width: r.l1 for r in records[tag] if r.module == module and r.t == t}

    # what mup's _record_coords records before the first update: x.abs().mean() of the module's output, here
    # computed directly on the 128-wide muP model (built again: its weights come from the config's seed)
    wide = config.replace(hidden_size=128)
    model = GPTModel(wide)
    apply_base_shapes(model, wide)
    with torch.no_grad():
        assert l1("up", "", 1)[128] == pytest.approx(float(model(batches[0][0]).abs().mean()), rel=1e-5)
        assert l1("up", "embedding", 1)[128] == pytest.approx(float(model.embedding(batches[0][0]).abs().mean()),
                                                              rel=1e-5)

    def slope(tag: str, module: str) -> float:
        at = sorted(l1(tag, module, 3).items())
        assert [w for w, _ in at] == [64, 128, 256, 512]
        return float(np.polyfit(np.log2([w for w, _ in at]), np.log2([v for _, v in at]), 1)[0])

    for module in ("", "layers.0", "layers.1.attention", "layers.1.mlp"):
        assert abs(slope("up", module)) < 0.2, module
        assert slope("sp", module) > 0.6, module
