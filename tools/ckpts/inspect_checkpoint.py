"""Show what a Deepy or GPT-NeoX checkpoint holds, or how two differ.

    python tools/ckpts/inspect_checkpoint.py CKPT            # a save dir (the checkpoint `load:` reads) or a tag dir
    python tools/ckpts/inspect_checkpoint.py CKPT --config   # also print the stored arguments
    python tools/ckpts/inspect_checkpoint.py --diff A B      # iteration, layout, args, tensors

Lists the model tensors (name, shape, dtype) of every model-parallel file, the layout (tp, pp, dp,
ZeRO stage), the file layout (GPT-NeoX's current or mid-2024 names, the grouped-query QKV order),
iteration, consumed samples and whether ``load:`` reads it. A save directory resolves to the
checkpoint ``load:`` would read (``checkpointing/discovery.py``: the newest committed Deepy checkpoint,
or the GPT-NeoX checkpoint ``latest`` names); where ``load:`` stops, this stops with the same message.
Files are read with ``torch.load(weights_only=True)``: inspecting a checkpoint never runs code from it.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megatron.checkpointing import commit, discovery
from megatron.checkpointing.neox import GQA_ORDER_OF_FORMAT, ORDER_KEY, load_model_file
from megatron.checkpointing.save_load import META_FILE
from megatron.errors import CheckpointError, UsageError, run_guarded

REPO = Path(__file__).resolve().parents[2]

@dataclass
class Snapshot:
    path: Path
    committed: bool
    meta: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    """``<file stem>/<param name>`` -> tensor, for every model file (one per tp/pp rank)."""
    gpt_neox: bool = False
    """A GPT-NeoX checkpoint (no deepy_meta.json): ``meta`` holds what its files record."""


def resolve(path: Path) -> tuple[Path, bool]:
    """(the checkpoint, whether it is GPT-NeoX's): a tag directory as given; for a save directory the
    one ``load:`` reads. Anything ``load:`` refuses stops here with its message."""
    if (path / META_FILE).is_file():
        return path, False
    found = discovery.inspect_load_dir(path)
    if found.kind == "gpt_neox" and found.foreign_tag is not None:
        return found.foreign_tag, True
    if found.kind == "deepy":
        tag, warnings = commit.newest_committed(path)
        for warning in warnings:
            print(f"note: {warning}", file=sys.stderr)
        if tag is not None:
            return path / tag, False
    if found.kind == "incomplete" and commit.step_of(path.name) is not None:
        return path, False  # one interrupted save: shown, marked as skipped by a load
    raise CheckpointError(discovery.explain(found, tp=1, pp=0))


def _neox_meta(ckpt: Path, states: dict[str, Any]) -> dict[str, Any]:
    """What a GPT-NeoX checkpoint records, as ``load:`` reads it (``checkpointing.neox.load.neox_position``)."""
    client = states.get("mp_rank_00_model_states.pt") or {}
    iteration = int(client.get("iteration") or client.get("global_steps") or 0)
    consumed = client.get("global_samples")
    pipeline = any(ckpt.glob("layer_*-model_*-model_states.pt"))
    ranks = {name.split("-model_")[1][:2] for name in states if name.startswith("layer_")} if pipeline else \
        {name for name in states if name.startswith("mp_rank_")}
    return {"iteration": iteration, "consumed_samples": consumed if consumed is not None else "?",
            "kind": "GPT-NeoX checkpoint (no deepy_meta.json: load: reads its weights)",
            "layout": {"tp": len(ranks), "pipeline": pipeline}, "args": client.get("args") or {}}


def read(path: Path) -> Snapshot:
    ckpt, gpt_neox = resolve(path)
    if not ckpt.is_dir():
        raise CheckpointError(f"{ckpt} is not a checkpoint directory")
    meta_path = ckpt / META_FILE
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    tensors: dict[str, torch.Tensor] = {}
    states: dict[str, Any] = {}
    files = sorted(ckpt.glob("mp_rank_*_model_states.pt")) + sorted(ckpt.glob("layer_*-model_*model_states.pt"))
    for file in files:
        state = load_model_file(file)
        states[file.name] = state
        module = state.get("module", state) if isinstance(state, dict) else {}
        for name, value in (module or {}).items():
            if torch.is_tensor(value):
                tensors[f"{file.name.removesuffix('_model_states.pt')}/{name}"] = value
    if gpt_neox:
        meta = _neox_meta(ckpt, states)
    committed = gpt_neox or commit.is_committed(ckpt)
    return Snapshot(ckpt, committed, meta, tensors, gpt_neox)


def _file_layout(snap: Snapshot) -> str:
    """Which of GPT-NeoX's eras the model files' names are, and the grouped-query QKV order."""
    names = {name.split("/", 1)[1] for name in snap.tensors}
    if any(".mlp.linear1." in f".{n}" for n in names):
        mlp = "GPT-NeoX's current names (mlp.linear1/linear2)"
    elif any(".mlp.w1." in f".{n}" for n in names) or snap.meta.get("format") == 2:
        mlp = "GPT-NeoX's mid-2024 names (mlp.dense_h_to_4h / w1, w2, w3)"
    elif any(n.startswith("sequential.") for n in names) or any(s.startswith("layer_") for s in snap.tensors):
        mlp = "GPT-NeoX's names"
    else:
        mlp = "Deepy's first layout (format 1)"
    fmt = snap.meta.get("format")
    if snap.gpt_neox:
        order = f"not recorded: loading a grouped-query model needs {ORDER_KEY}"
    elif fmt in GQA_ORDER_OF_FORMAT:
        order = f"{GQA_ORDER_OF_FORMAT[fmt]} (format {fmt})"
    else:
        order = f"Deepy's [q; k; v] (format {fmt})"
    return f"{mlp}; grouped-query QKV rows {order}"


def describe(snap: Snapshot, show_config: bool) -> str:
    meta = snap.meta
    loads = "yes" if snap.committed else "NO (incomplete: a load skips it)"
    lines = [
        f"checkpoint        {snap.path}",
        f"load: reads it    {loads}",
        f"iteration         {meta.get('iteration', '?')}",
        f"consumed samples  {meta.get('consumed_samples', '?')}",
        f"kind              {meta.get('kind', '?')}",
        f"layout            {_layout(meta)}",
        f"file layout       {_file_layout(snap)}",
    ]
    configs = sorted(p.name for p in (snap.path / "configs").glob("*")) if (snap.path / "configs").is_dir() else []
    lines.append(f"config files      {', '.join(configs) or '-'}")
    total = sum(t.numel() for t in snap.tensors.values())
    lines.append(f"tensors           {len(snap.tensors)} ({total:,} elements across model-parallel files)")
    width = max((len(n) for n in snap.tensors), default=10)
    for name, tensor in snap.tensors.items():
        lines.append(f"  {name:<{width}}  {str(list(tensor.shape)):<18} {str(tensor.dtype).removeprefix('torch.')}")
    if show_config:
        lines.append("arguments")
        for key, value in sorted(meta.get("args", {}).items()):
            if value is not None:
                lines.append(f"  {key}: {json.dumps(value)}")
    return "\n".join(lines)


def _layout(meta: dict[str, Any]) -> str:
    layout = meta.get("layout")
    if not layout:
        return "?"
    shown = " ".join(f"{key}={layout[key]}" for key in ("tp", "pp", "dp", "zero_stage") if key in layout)
    return shown + ("" if "pp" in layout or "pipeline" not in layout else
                    f" {'pipeline' if layout['pipeline'] else 'plain (pipe_parallel_size: 0)'}")


def diff(a: Snapshot, b: Snapshot) -> tuple[str, bool]:
    """A readable difference report and whether the two are identical in what was compared."""
    lines = [f"A = {a.path}", f"B = {b.path}"]
    same = True
    for key in ("iteration", "consumed_samples"):
        if a.meta.get(key) != b.meta.get(key):
            same = False
            lines.append(f"{key}: A {a.meta.get(key)}  B {b.meta.get(key)}")
    if _layout(a.meta) != _layout(b.meta):
        same = False
        lines.append(f"layout: A {_layout(a.meta)}  B {_layout(b.meta)}  (tensor files are compared by name only)")
    args_a, args_b = a.meta.get("args", {}), b.meta.get("args", {})
    for key in sorted(set(args_a) | set(args_b)):
        if key in ("iteration", "config_files") or args_a.get(key) == args_b.get(key):
            continue
        same = False
        lines.append(f"arg {key}: A {json.dumps(args_a.get(key))}  B {json.dumps(args_b.get(key))}")
    for name in sorted(set(a.tensors) | set(b.tensors)):
        ta, tb = a.tensors.get(name), b.tensors.get(name)
        if ta is None or tb is None:
            same = False
            lines.append(f"tensor {name}: only in {'B' if ta is None else 'A'}")
        elif ta.shape != tb.shape:
            same = False
            lines.append(f"tensor {name}: shape A {list(ta.shape)}  B {list(tb.shape)}")
        else:
            delta = (ta.float() - tb.float()).abs().max().item() if ta.numel() else 0.0
            if delta != 0.0:
                same = False
                lines.append(f"tensor {name}: max |A-B| = {delta:.3e}")
    lines.append("identical" if same else "different")
    return "\n".join(lines), same


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", nargs="?", type=Path, help="save directory or checkpoint (tag) directory")
    parser.add_argument("--diff", nargs=2, type=Path, metavar=("A", "B"), help="compare two checkpoints")
    parser.add_argument("--config", action="store_true", help="print the stored arguments")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    opts = parser.parse_args()
    if opts.diff:
        report, same = diff(read(opts.diff[0]), read(opts.diff[1]))
        print(report)
        return 0 if same else 1
    if opts.checkpoint is None:
        raise UsageError("give a checkpoint directory, or --diff A B")
    print(describe(read(opts.checkpoint), opts.config))
    return 0


def cli() -> None:
    """The ``deepy-inspect-checkpoint`` console script: clean one-line errors, exit code 2."""
    run_guarded(main)


if __name__ == "__main__":
    cli()
