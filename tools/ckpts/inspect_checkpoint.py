"""Show what a Deepy checkpoint holds, or how two differ.

    python tools/ckpts/inspect_checkpoint.py CKPT            # a save dir (newest committed) or a tag dir
    python tools/ckpts/inspect_checkpoint.py CKPT --config   # also print the stored arguments
    python tools/ckpts/inspect_checkpoint.py --diff A B      # iteration, layout, args, tensors

Lists the model tensors (name, shape, dtype) of every model-parallel file, the layout (tp, pp, dp,
ZeRO stage), iteration, consumed samples and whether the checkpoint is committed. Files are read
with ``torch.load(weights_only=True)``: inspecting a checkpoint never runs code from it.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megatron.checkpointing import commit
from megatron.checkpointing.safe_load import load_checkpoint_file
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


def resolve(path: Path) -> Path:
    """A tag directory as given, or the newest committed checkpoint of a save directory."""
    if (path / META_FILE).is_file() or commit.step_of(path.name) is not None:
        return path
    tag, warnings = commit.newest_committed(path)
    for warning in warnings:
        print(f"note: {warning}", file=sys.stderr)
    if tag is None:
        raise CheckpointError(f"{path} holds no committed checkpoint")
    return path / tag


def read(path: Path) -> Snapshot:
    ckpt = resolve(path)
    if not ckpt.is_dir():
        raise CheckpointError(f"{ckpt} is not a checkpoint directory")
    meta_path = ckpt / META_FILE
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    tensors: dict[str, torch.Tensor] = {}
    files = sorted(ckpt.glob("mp_rank_*_model_states.pt")) + sorted(ckpt.glob("layer_*-model_*model_states.pt"))
    for file in files:
        state = load_checkpoint_file(file)
        module = state.get("module", state) if isinstance(state, dict) else {}
        for name, value in (module or {}).items():
            if torch.is_tensor(value):
                tensors[f"{file.name.removesuffix('_model_states.pt')}/{name}"] = value
    return Snapshot(ckpt, commit.is_committed(ckpt), meta, tensors)


def describe(snap: Snapshot, show_config: bool) -> str:
    meta = snap.meta
    lines = [
        f"checkpoint        {snap.path}",
        f"committed         {'yes' if snap.committed else 'NO (incomplete: a load skips it)'}",
        f"iteration         {meta.get('iteration', '?')}",
        f"consumed samples  {meta.get('consumed_samples', '?')}",
        f"kind              {meta.get('kind', '?')}",
        f"layout            {_layout(meta)}",
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
    return " ".join(f"{key}={layout[key]}" for key in ("tp", "pp", "dp", "zero_stage") if key in layout)


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
