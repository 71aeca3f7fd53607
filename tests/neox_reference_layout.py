"""GPT-NeoX's checkpoint layout, written by test code from its published rules (not by Deepy's code).

The rules, as GPT-NeoX's ``megatron/model/gpt2_model.py`` (pipeline layer list),
``megatron/model/transformer.py`` (QKV split, ``ParallelMLP``, ``Gated_Activation``) and
``tools/ckpts/convert_hf_llama_to_neox.py`` / ``convert_neox_to_hf.py`` publish them, in two eras
(EleutherAI/gpt-neox ea7aefd8 for ``current``; its parent of 0d4bdb96, #1212, for ``mid2024``):

* layer 0 the embedding, blocks at 2..L+1, the final norm at L+3, an untied head at L+4
  (``final_linear.weight``); layers 1 and L+2 hold no parameters;
* pipeline files ``layer_XX-model_TT-model_states.pt`` (names inside the layer), plain models
  ``mp_rank_TT_model_states.pt["module"]`` with ``sequential.<layer>.<name>``;
* the QKV weight, multi-head attention (any era): q, k and v each viewed as ``[heads, d, hidden]``,
  chunked over tp along the head dimension, each chunk's three concatenated along the ``d``
  dimension (per head ``[q_h; k_h; v_h]``);
* grouped-query, ``current`` (``convert_hf_llama_to_neox.py`` since #1345): q, k and v each chunked
  over tp, each rank's ``[q; k; v]`` concatenated; ``mid2024`` (before #1345): q, k and v each viewed
  as ``[heads, rows per query head, hidden]`` and then as for multi-head attention;
* norms: ``scale`` for rmsnorm (llama-style), ``weight``/``bias`` for layernorm;
* MLP, ``current``: ``linear1``/``linear2``, a gated ``linear1`` holding each rank's up rows, then its
  gate rows (``torch.cat([w3, w1])`` per rank in ``convert_hf_llama_to_neox.py``); ``mid2024``:
  llama-style ``w1`` (gate), ``w3`` (up), ``w2`` (down), neox-style ``dense_h_to_4h``/``dense_4h_to_h``;
* column-parallel weights and the vocabulary split on dim 0 over tp, row-parallel weights on dim 1.

Input: full tensors under Deepy's ``GPTModel`` names (fused ``[q; k; v]`` and ``[gate; up]`` rows).
"""

from __future__ import annotations

from pathlib import Path

import torch


def neox_files(full: dict[str, torch.Tensor], *, num_layers: int, heads: int, kv_heads: int, tp: int,
               pipeline: bool, llama: bool, era: str = "current") -> dict[str, dict[str, torch.Tensor]]:
    """file name -> its tensors (pipeline) or its ``module`` dict (plain), one per tp rank."""
    assert era in ("current", "mid2024")
    per_layer: list[dict[int, dict[str, torch.Tensor]]] = [{} for _ in range(tp)]

    def put(layer: int, name: str, parts: list[torch.Tensor]) -> None:
        for rank in range(tp):
            per_layer[rank].setdefault(layer, {})[name] = parts[rank].clone()

    def column(t: torch.Tensor) -> list[torch.Tensor]:
        return list(torch.chunk(t, tp, dim=0))

    def row(t: torch.Tensor) -> list[torch.Tensor]:
        return list(torch.chunk(t, tp, dim=1))

    def same(t: torch.Tensor) -> list[torch.Tensor]:
        return [t] * tp

    norm_field = "scale" if llama else "weight"
    for name, t in full.items():
        if name.startswith("embedding."):
            put(0, name.removeprefix("embedding."), column(t) if "word_embeddings" in name else same(t))
        elif name.startswith("final_norm."):
            field = name.removeprefix("final_norm.")
            put(num_layers + 3, f"norm.{norm_field if field == 'weight' else field}", same(t))
        elif name == "output_layer.weight":
            put(num_layers + 4, "final_linear.weight", column(t))
        else:
            _, i, local = name.split(".", 2)
            layer = int(i) + 2
            if local.endswith("layernorm.weight"):
                put(layer, local.replace(".weight", f".{norm_field}"), same(t))
            elif "layernorm" in local:
                put(layer, local, same(t))
            elif local.startswith("attention.query_key_value."):
                hidden_rest = t.shape[1:]
                d = t.shape[0] // (heads + 2 * kv_heads)
                q, k, v = t.split([heads * d, kv_heads * d, kv_heads * d])
                if kv_heads != heads and era == "current":
                    chunks = [torch.cat([qc, kc, vc]) for qc, kc, vc in zip(q.chunk(tp), k.chunk(tp), v.chunk(tp))]
                else:
                    q, k, v = (x.reshape(heads, -1, *hidden_rest) for x in (q, k, v))
                    chunks = [torch.cat([qc, kc, vc], dim=1).reshape(-1, *hidden_rest)
                              for qc, kc, vc in zip(q.chunk(tp), k.chunk(tp), v.chunk(tp))]
                put(layer, local, chunks)
            elif local.startswith("attention.dense."):
                put(layer, local, row(t) if local.endswith("weight") else same(t))
            elif local.startswith("mlp.dense_h_to_4h.") and era == "current":
                field = local.rsplit(".", 1)[1]
                if llama:
                    gate, up = t.chunk(2)
                    put(layer, f"mlp.linear1.{field}", [torch.cat([u, g]) for u, g in zip(column(up), column(gate))])
                else:
                    put(layer, f"mlp.linear1.{field}", column(t))
            elif local.startswith("mlp.dense_4h_to_h.") and era == "current":
                put(layer, f"mlp.linear2.{local.rsplit('.', 1)[1]}", row(t) if local.endswith("weight") else same(t))
            elif local.startswith("mlp.dense_h_to_4h.") and llama:
                field = local.rsplit(".", 1)[1]
                gate, up = t.chunk(2)
                put(layer, f"mlp.w1.{field}", column(gate))
                put(layer, f"mlp.w3.{field}", column(up))
            elif local.startswith("mlp.dense_4h_to_h.") and llama:
                put(layer, f"mlp.w2.{local.rsplit('.', 1)[1]}", row(t) if local.endswith("weight") else same(t))
            elif local.startswith("mlp.dense_h_to_4h."):
                put(layer, local, column(t))
            elif local.startswith("mlp.dense_4h_to_h."):
                put(layer, local, row(t) if local.endswith("weight") else same(t))
            else:
                raise AssertionError(f"the reference layout does not place {name}")
    files: dict[str, dict[str, torch.Tensor]] = {}
    for rank in range(tp):
        if pipeline:
            for layer, tensors in per_layer[rank].items():
                files[f"layer_{layer:02d}-model_{rank:02d}-model_states.pt"] = tensors
        else:
            files[f"mp_rank_{rank:02d}_model_states.pt"] = {
                f"sequential.{layer}.{n}": t for layer, tensors in per_layer[rank].items() for n, t in tensors.items()
            }
    return files


def write_neox_checkpoint(save: Path, tag: str, files: dict[str, dict[str, torch.Tensor]], *, pipeline: bool,
                          tp: int, iteration: int) -> Path:
    """A checkpoint as GPT-NeoX writes one: ``latest`` naming ``tag``, no ``configs/``, and in its
    ``mp_rank_XX`` files the RNG states its training saves (``np_rng_state``: numpy objects)."""
    import numpy as np

    rng = {"random_rng_state": (3, tuple(range(5)), None), "np_rng_state": np.random.RandomState(0).get_state(),
           "torch_rng_state": torch.get_rng_state()}
    ckpt = save / tag
    ckpt.mkdir(parents=True)
    for name, tensors in files.items():
        if pipeline:
            torch.save(tensors, ckpt / name)
        else:
            torch.save({"dp_world_size": 1, "mp_world_size": tp, "optimizer": {}, "global_steps": iteration,
                        "skipped_steps": 0, "iteration": iteration, "module": tensors, **rng}, ckpt / name)
    if pipeline:
        for rank in range(tp):
            torch.save({"dp_world_size": 1, "mp_world_size": tp, "optimizer": {}, "global_steps": iteration,
                        "iteration": iteration, "module": None, **rng}, ckpt / f"mp_rank_{rank:02d}_model_states.pt")
    (save / "latest").write_text(tag)
    return ckpt
