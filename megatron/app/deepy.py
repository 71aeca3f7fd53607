"""``deepy.py``'s command line: parse argv, resolve the config, then print it (``--dry-run``) or launch.

    python deepy.py [--dry-run] [--verbose] [--debug] [-d DIR] USER_SCRIPT CONFIG... [key=value ...]

Nothing heavy (torch, DeepSpeed) is imported before it is needed, so ``--dry-run`` and every config
error come back in well under a second of Python start-up.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from megatron import object_store
from megatron.app.prepare import run_steps
from megatron.checkpointing.discovery import resume_point
from megatron.checkpointing.remote import remote_resume_point, staging_dir
from megatron.config_rules import DERIVED, RuleContext, describe
from megatron.engine.memory import memory_fit as fit_of
from megatron.engine.optimizer_config import peak_lr_setting
from megatron.errors import ConfigError, UsageError, required
from megatron.interop.hf_start import CONVERTED_MARKER, HfImport, start_from_hf
from megatron.launcher import check_tools, plan_launch, requeue, restarts
from megatron.launcher.checks import runs_on_this_machine
from megatron.launcher.config import DeepSpeedRunnerArgs
from megatron.launcher.environment import started_by_scheduler
from megatron.launcher.requeue import requeue_after_stop
from megatron.launcher.save_lock import SaveDirInUse, acquire, current_holder, this_process
from megatron.logging import rank_errors
from megatron.logging.config import LoggingArgs
from megatron.logging.console import is_verbose
from megatron.logging.rank_errors import current_rank
from megatron.logging.trackers import new_run_name
from megatron.neox_arguments import detect_world_size, finalize
from megatron.neox_arguments.arguments import NeoXArgs
from megatron.neox_arguments.component_groups import group
from megatron.neox_arguments.derived import local_device_count
from megatron.neox_arguments.dialects import split_argv
from megatron.neox_arguments.honesty import NO_EFFECT_KEYS, check_entry_point
from megatron.neox_arguments.loading import load_config
from megatron.neox_arguments.overrides import looks_like_override
from megatron.neox_arguments.provenance import format_resolved_table
from megatron.neox_arguments.resolved import RESOLVED_FILE_NAME, ResolvedConfig, run_directory
from megatron.neox_arguments.run_config import RunConfig
from megatron.object_store import is_remote
from megatron.training.step_saves import save_due, step_dir

ENTRY_POINTS_OF_TEXTGEN = ("generate.py", "eval.py")
"""The entry points that read the text-generation/evaluation keys."""

if TYPE_CHECKING:
    from megatron.config_rules import Device
    from megatron.launcher import LaunchPlan
    from megatron.launcher.save_lock import Holder, SaveLock
    from megatron.engine.memory import MemoryFit
    from megatron.neox_arguments.dialects import Flag

USAGE = ("deepy.py [--dry-run] [--verbose] [--debug] [--rehearse N] [-d CONF_DIR] USER_SCRIPT CONFIG [CONFIG ...] "
         "[key=value ...]\n"
         "       deepy.py [--dry-run] USER_SCRIPT --config_path LEVANTER.yaml [--section.key value ...]\n"
         "       deepy.py [--dry-run] USER_SCRIPT [FMS.yaml] --key=value ... (fms-fsdp's flags)")


@dataclass(frozen=True)
class DeepyCommand:
    user_script: str
    config_files: list[str]
    overrides: list[str]
    conf_dir: str | None = None
    dry_run: bool = False
    debug: bool = False
    verbose: bool = False
    """Show the libraries' own lines (DeepSpeed's INFO lines, the launch command, every rank's place)."""
    dialect_flags: tuple[Flag, ...] = ()
    """Levanter's ``--config_path F``/``--a.b value`` or fms-fsdp's ``--key=value`` flags."""
    rehearse: int | None = None
    """``--rehearse N``: check and show a launch of N ranks on this machine, train nothing (megatron/app/rehearsal.py)."""


class _Parser(argparse.ArgumentParser):
    """argparse that raises :class:`UsageError` instead of printing and exiting by itself."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message}\nusage: {USAGE}")


EPILOG = """\
examples (from the repository root, after the README's quick start):
  python deepy.py train.py configs/tiny.yml configs/local_setup.yml         train (resumes from `load`)
  python deepy.py --dry-run train.py configs/125M.yml configs/local_setup.yml
                                                  check everything, print the resolved config, launch nothing
  python deepy.py train.py -d configs tiny local_setup train_iters=50      key=value overrides come last
  python deepy.py generate.py configs/tiny.yml configs/local_setup.yml text_gen_type=unconditional
  python deepy.py --rehearse 1024 train.py configs/llama2/70B.yml configs/local_setup.yml pipe_parallel_size=8 \\
         save=checkpoints_70b load=checkpoints_70b
                                                  every check as at 1,024 ranks, then each rank's parameters, ZeRO
                                                  shards, traffic and memory; nothing trains (docs/rehearsal.md)

Every config mistake stops deepy.py before anything starts: one message naming the key and its
file:line, exit code 2. Keys: configs/neox_arguments.md."""


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="deepy.py",
        usage=USAGE,
        description="Resolve GPT-NeoX-style YAML configs and launch USER_SCRIPT (train.py, generate.py, eval.py) "
                    "on every rank.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--dry-run", action="store_true", help="run every check, print the resolved config, launch nothing")
    parser.add_argument("--rehearse", type=int, metavar="N", default=None,
                        help="run every check as a launch of N ranks would, then show each rank's parameters, ZeRO "
                             "shards, communication and memory; launch nothing, use no GPU (docs/rehearsal.md)")
    parser.add_argument("--verbose", action="store_true",
                        help="show the libraries' own output too: DeepSpeed's INFO lines and step line, the launch "
                             "command, each rank's place in the layout (deepspeed_log_level=info)")
    parser.add_argument("--debug", action="store_true", help="--verbose, and tracebacks of errors")
    parser.add_argument("-d", "--conf_dir", "--conf-dir", default=None, help="directory the CONFIG names are relative to")
    parser.add_argument("user_script", metavar="USER_SCRIPT", help="the script each rank runs, e.g. train.py")
    parser.add_argument("rest", nargs="*", metavar="CONFIG|key=value", help="config files, then key=value overrides")
    return parser


def parse_command(argv: Sequence[str]) -> DeepyCommand:
    """Split argv into the user script, config files (in order), trailing overrides and dialect flags."""
    rest, dialect_flags = split_argv(argv)
    ns = _parser().parse_intermixed_args(rest)
    configs: list[str] = []
    overrides: list[str] = []
    for token in ns.rest:
        if looks_like_override(token):
            overrides.append(token)
        elif overrides:
            raise UsageError(
                f"bad override '{token}': write key=value (config files go before the overrides, "
                f"and '{token}' comes after '{overrides[-1]}')"
            )
        else:
            configs.append(token)
    if looks_like_override(ns.user_script):
        raise UsageError(f"the first argument must be the user script (e.g. train.py), got '{ns.user_script}'")
    if not os.path.isfile(ns.user_script):
        raise UsageError(f"user script not found: {ns.user_script}")
    if not configs and not dialect_flags:
        raise UsageError(f"no config file given after {ns.user_script}\nusage: {USAGE}")
    if ns.rehearse is not None and ns.rehearse < 1:
        raise UsageError(f"--rehearse takes the number of ranks to rehearse (1 or more), got {ns.rehearse}")
    return DeepyCommand(ns.user_script, configs, overrides, ns.conf_dir, ns.dry_run, ns.debug,
                        ns.verbose or ns.debug, tuple(dialect_flags), ns.rehearse)


def resolve(command: DeepyCommand, device: Device | None = None, world: int | None = None) -> ResolvedConfig:
    """Every check of a real launch: load and type-check, then the rules that need the world size (and this
    machine's ``device``, detected when None). ``world``: the world size when the caller knows it (a worker
    torchrun started, a rehearsal), instead of the one the launcher keys would start here."""
    resolved = load_config(command.config_files, command.overrides, command.conf_dir, command.dialect_flags)
    prepare_data(resolved)
    fill_in_for_inference(resolved, command.user_script)
    resolved.entry_point = command.user_script  # what the run loads is checked as this script loads it
    if world is None:
        world = detect_world_size(resolved.args, warnings=resolved.warnings)
    final = finalize(resolved, world, device=device)
    check_entry_point(final.args, command.user_script)
    return final


def prepare_data(resolved: ResolvedConfig) -> None:
    """A dialect config's data conversion (a Levanter sft.py config's chats), run once before the data are
    checked (``megatron/app/prepare.py``); not where every rank runs deepy.py itself (they would race)."""
    args = resolved.args
    in_place = started_by_scheduler(os.environ, slurm=args.deepspeed_slurm, mpi=args.deepspeed_mpi) is not None
    for line in run_steps(resolved.dialect, in_place=in_place):
        print(f"deepy: {line}", flush=True)


def fill_in_for_inference(resolved: ResolvedConfig, user_script: str) -> None:
    """generate.py and eval.py build the training engine around the loaded weights but never step it:
    a config that only describes the model (the ``deepy_model.yml`` an HF import writes) gets one-sample
    batches, a zero learning rate, one iteration and (except for precompute, which scores the data)
    placeholder data, each recorded as derived and said, instead of refusals for keys inference does
    not read."""
    if os.path.basename(user_script) not in ENTRY_POINTS_OF_TEXTGEN:
        return
    args = resolved.args
    fills: dict[str, Any] = {}
    if args.train_micro_batch_size_per_gpu is None and args.train_batch_size is None:
        fills["train_micro_batch_size_per_gpu"] = 1
    if peak_lr_setting(args.lr, args.optimizer)[0] is None:
        fills["lr"] = 0.0
    if args.train_iters is None and args.train_epochs is None:
        fills["train_iters"] = 1
    has_data = any(getattr(args, key) for key in ("data_path", "train_data_paths", "train_urls", "pos_train_data_paths"))
    if not has_data and not args.use_dummy_dataset and args.text_gen_type != "precompute":
        fills["use_dummy_dataset"] = True
    for key, value in fills.items():
        setattr(args, key, value)
        resolved.provenance[key] = DERIVED
    if fills:
        shown = ", ".join(f"{key}={value}" for key, value in fills.items())
        resolved.warnings.append(f"{os.path.basename(user_script)} does not train: filled in {shown} for the "
                                 f"engine that holds the weights (none of them is read by inference)")


def assign_run_dir(resolved: ResolvedConfig, user_script: str) -> str:
    """The run's one directory, unless already chosen: ``run_dir`` when set, else ``<log_dir>/<run
    name>`` (the directory its metrics.jsonl goes to): the name a resumed run's checkpoint records, or
    a fresh one. Stored in the resolved config with the name, which the ranks then use."""
    if not resolved.directory:
        if not resolved.args.run_dir:
            resolved.run_name = resumed_run_name(resolved, user_script) or new_run_name()
        resolved.directory = str(run_directory(resolved.args, run_name=resolved.run_name))
    return resolved.directory


def resumed_run_name(resolved: ResolvedConfig, user_script: str) -> str | None:
    """The name of the run a training launch continues (its checkpoint in ``load`` records it), or None."""
    args = resolved.args
    if os.path.basename(user_script) in ENTRY_POINTS_OF_TEXTGEN or not args.load or not args.load_checkpoint:
        return None
    if args.finetune:
        return None
    found = starting_point(args.load, args.iteration)
    if found is None:
        return None
    state = (found[1].get("extra") or {}).get("train_state") or {}
    name = state.get("run_name")
    return name if isinstance(name, str) and name and os.sep not in name else None


def hf_start(resolved: ResolvedConfig, in_place: bool) -> str | None:
    """``initialize_from_hf``: convert the model into ``<save>/hf_import`` once, before any rank starts
    (``megatron/interop/hf_start.py``), and start from there."""
    args = resolved.args
    if not args.initialize_from_hf:
        return None
    if is_remote(args.save):
        raise ConfigError(f"initialize_from_hf converts the model into <save>/hf_import, and save={args.save} is in "
                          "object storage: convert first with python tools/ckpts/convert_hf_to_neox.py "
                          f"{args.initialize_from_hf} DIR, then start from it with initialize_from: DIR")
    save = Path(required(args.save, "save", "initialize_from_hf converts the model into <save>/hf_import"))
    plan = HfImport(str(args.initialize_from_hf), save, args.model_parallel_size or 1, args.pipe_parallel_size,
                    str(args.precision),
                    required(args.seq_length, "seq_length", "the converted model's positions follow it"))
    own = any(resume_point(Path(d), None) is not None for d in {args.save, args.load} if d and Path(d).is_dir())
    if in_place and not own and not (plan.target / CONVERTED_MARKER).is_file():
        raise ConfigError(f"initialize_from_hf with a launch where every rank runs deepy.py itself: convert first "
                          f"with python tools/ckpts/convert_hf_to_neox.py {args.initialize_from_hf} "
                          f"{plan.target}, then launch again")
    note = start_from_hf(plan, has_own_checkpoint=own)
    # a restart with its own checkpoint keeps initialize_from too: the checkpoint recorded it (the same run)
    args.initialize_from = str(plan.target)
    resolved.provenance["initialize_from"] = "derived (initialize_from_hf, converted before launch)"
    return note


def already_finished(resolved: ResolvedConfig, user_script: str) -> str | None:
    """Why launching would do nothing, or None: a training run whose checkpoint in ``load`` is
    already at its last step (``train_iters``) has nothing left to train (the loop saves the last step
    just before the final evaluations, so a failed one costs no training). Only files are read (the commit
    markers and ``deepy_meta.json``), so this costs no rank start-up. A finished run whose last HF or PEFT
    save is missing (killed while writing it) is launched: its ranks write it (said in ``resolved.warnings``).

    With ``train_epochs`` the last step is derived from the data at start-up; the checkpoint records
    it, and it is trusted when the checkpoint was trained for the same number of epochs.
    """
    args = resolved.args
    if os.path.basename(user_script) in ENTRY_POINTS_OF_TEXTGEN or not args.load or not args.load_checkpoint:
        return None
    if args.finetune:
        return None  # fine-tuning starts at step 0 from the loaded weights
    found = starting_point(args.load, args.iteration)
    if found is None:
        return None
    ckpt, meta = found
    stored = meta.get("args") or {}
    last = args.train_iters
    if not last and args.train_epochs and stored.get("train_epochs") == args.train_epochs:
        last = stored.get("train_iters")
    done = meta.get("iteration")
    if not isinstance(last, int) or not isinstance(done, int) or last <= 0 or done < last:
        return None
    unwritten = unwritten_last_saves(resolved, done)
    if unwritten:
        # the ranks resume at the end and write it from the checkpoint (StepSaves.resume)
        resolved.warnings.append(f"already finished at iteration {done} (checkpoint {ckpt}), but its last save "
                                 f"{' and '.join(unwritten)} is missing (a run killed while writing it): launching "
                                 f"to write it from that checkpoint")
        return None
    return f"already finished at iteration {done} (checkpoint {ckpt}): nothing to do"


def unwritten_last_saves(resolved: ResolvedConfig, done: int) -> list[str]:
    """The saves due after the last step (``hf_save_path``, ``lora_peft_save_path``: Levanter's forced hook) of a
    run finished at ``done`` steps that are not on disk, as ``key: directory``."""
    args = resolved.args
    saves = [("hf_save_path", args.hf_save_path, args.hf_save_interval),
             ("lora_peft_save_path", args.lora_peft_save_path, args.lora_peft_save_interval)]
    return [f"{key}: {step_dir(base, done)}" for key, base, every in saves
            if base is not None and save_due(done, int(every), last=True) and not written(base, done)]


def written(base: str, done: int) -> bool:
    """The step save of ``done`` steps is in ``base`` (a directory, or a bucket's prefix)."""
    name = step_dir(base, done)
    if not is_remote(base):
        return name.is_dir()
    return bool(object_store.store_for(base).list(object_store.join(base, name.name)))


def notes(resolved: ResolvedConfig, user_script: str) -> list[str]:
    """What deepy.py says before launching: warnings, checks skipped and why, and keys the config
    sets that change nothing here."""
    lines = [f"warning: {w}" for w in resolved.warnings]
    lines += [f"not checked here: {s}" for s in resolved.skipped]
    for key, reason in NO_EFFECT_KEYS.items():
        if key in resolved.provenance and resolved.provenance[key] != "derived":
            lines.append(f"no effect here: {key} ({reason})")
    elsewhere = [key for key in resolved.provenance
                 if "." not in key and NeoXArgs.has_field(key) and NeoXArgs.group_of(key) == "textgen"]
    if elsewhere and os.path.basename(user_script) not in ENTRY_POINTS_OF_TEXTGEN:
        lines.append(f"applies elsewhere: {', '.join(sorted(elsewhere))} configure "
                     f"{' and '.join(ENTRY_POINTS_OF_TEXTGEN)}, not {os.path.basename(user_script)}")
    return lines


def render_dry_run(resolved: ResolvedConfig, command: DeepyCommand, plan: LaunchPlan | None = None,
                   fit: MemoryFit | None = None) -> str:
    ds_config: Any = resolved.deepspeed_config
    said = notes(resolved, command.user_script)
    parts = [
        f"deepy: dry run of {command.user_script} with "
        + " ".join([*command.config_files, *command.overrides, *(f.text for f in command.dialect_flags)]),
        "",
        *dialect_table(resolved),
        "Resolved config (non-default values; source is file:line, cli or derived):",
        format_resolved_table(resolved.args, resolved.provenance),
        "",
        f"Run directory: {resolved.directory} (not created by a dry run)",
        "",
        "DeepSpeed config:",
        json.dumps(ds_config, indent=2) if ds_config is not None else "(none)",
        "",
        fit.report() if fit is not None else memory_report(resolved),
        "",
        *([*said, ""] if said else []),
    ]
    if plan is not None:
        parts += [f"Launch: {plan.world_size} rank(s) via {plan.mode}: {shlex.join(plan.argv)}", ""]
    parts += [*resilience_lines(resolved), ""]
    parts.append("deepy: dry run OK, nothing launched")
    return "\n".join(parts)


def resilience_lines(resolved: ResolvedConfig) -> list[str]:
    """The dry run's block on what the run does when a rank dies, hangs or is stopped by its scheduler."""
    args = resolved.args
    restarts = (f"restarts: up to {args.max_restarts} relaunch(es) from the last checkpoint when a rank dies or "
                f"hangs (max_restarts)" if args.max_restarts else "restarts: none, a failed rank ends the run "
                "(max_restarts: 0)")
    if args.launcher == "torchrun" and args.max_restarts:
        restarts = (f"restarts: torchrun's agents restart the ranks up to {args.max_restarts} time(s) from the last "
                    f"checkpoint when one dies or hangs (max_restarts, their --max-restarts)")
    hang = ", ".join(f"{key}={getattr(args, key)}" for key in ("hang_timeout", "startup_hang_timeout"))
    lines = ["Resilience:", f"  {restarts}",
             f"  hang watch: {hang} (null: off)",
             f"  collective timeouts: init_timeout_seconds={args.init_timeout_seconds} (through the first step), "
             f"train_timeout_seconds={args.train_timeout_seconds} (after it)",
             f"  stragglers: straggler_factor={args.straggler_factor} over straggler_window={args.straggler_window} "
             f"steps (null: off)"]
    if args.launcher == "slurm":
        lines.append(f"  {requeue.describe(args.slurm_requeue, args.max_requeues_without_progress)}")
    return lines


def dialect_table(resolved: ResolvedConfig) -> list[str]:
    """``key  where  -> neox_key=value, ...`` for each key of a Levanter or fms-fsdp config."""
    if not resolved.dialect:
        return []
    rows = resolved.dialect["rows"]
    lines = [f"{resolved.dialect['name']} keys and the GPT-NeoX keys they became:"]
    width = max((len(row["key"]) for row in rows), default=0)
    place = max((len(row["where"]) for row in rows), default=0)
    for row in rows:
        became = ", ".join(f"{k}={json.dumps(v, default=str)}" for k, v in row["neox"].items())
        if row.get("note"):  # accepted at a value that is what Deepy does anyway, and why
            became = f"{became}  ({row['note']})" if became else f"(nothing to set: {row['note']})"
        became = became or "(nothing to set: Deepy's default)"
        lines.append(f"  {row['key']:<{width}}  {row['where']:<{place}}  -> {became}")
    return [*lines, ""]


def plan_run(resolved: ResolvedConfig, user_script: str, config_path: str) -> LaunchPlan:
    """Every launch check (ports, tools, hosts) before anything is written or started."""
    runner = group(resolved.args, DeepSpeedRunnerArgs)  # the launcher's own keys, and the log level it passes on
    plan = plan_launch(runner, user_script, config_path, os.environ, local_devices=local_device_count,
                       provenance=resolved.provenance, logging=group(resolved.args, LoggingArgs))
    check_tools(plan, runner)
    return plan


def memory_report(resolved: ResolvedConfig) -> str:
    """Per-device memory estimate of the resolved layout (see megatron/engine/memory.py)."""
    return memory_fit(resolved).report()


def memory_fit(resolved: ResolvedConfig) -> MemoryFit:
    """The memory estimate of the resolved run against what its ranks will have (megatron/engine/memory.py)."""
    return fit_of(RunConfig.from_resolved(resolved),
                  launches_locally=runs_on_this_machine(RuleContext(args=resolved.args)))


def check_memory(resolved: ResolvedConfig, fit: MemoryFit, user_script: str) -> None:
    """Refuse a training run whose memory estimate exceeds what the ranks of a node have, naming the key
    behind the largest part of it (``allow_memory_overcommit: true`` makes it a warning). Inference
    (generate.py, eval.py) builds no optimizer states nor activations for a backward: not checked."""
    if os.path.basename(user_script) in ENTRY_POINTS_OF_TEXTGEN:
        return
    ctx = RuleContext(args=resolved.args, provenance=resolved.provenance)
    problem = fit.problem()
    if problem is None:
        if fit.warning() is not None:
            resolved.warnings.append(f"{fit.warning()}")
        return
    why, key = problem
    if resolved.args.allow_memory_overcommit:
        resolved.warnings.append(f"{why}; launching anyway ({ctx.show('allow_memory_overcommit')})")
        return
    largest = fit.largest_part()
    advice = {
        "activations": "lower it (raise gradient_accumulation_steps to keep the batch), recompute activations "
                       "(checkpoint_activations: true), or use fewer ranks per machine",
        "ZeRO gradient buckets": "lower zero_optimization.reduce_bucket_size",
        "model states": "split the model over more devices (a higher ZeRO stage, tensor or pipeline parallelism) "
                        "or offload the optimizer",
    }[largest]
    # the ZeRO block is long: its stage is what splits the model states and sizes the buckets
    shown = (f"zero_optimization.stage={fit.layout.zero_stage} ({describe(ctx.source(key))})"
             if key == "zero_optimization" else ctx.show(key))
    raise ConfigError(f"{why}: the most of it is {largest} ({shown}): {advice}; or set "
                      f"allow_memory_overcommit: true to launch anyway (the kernel kills a rank that runs out of "
                      f"memory: exit code 137)")


def take_save_lock(resolved: ResolvedConfig, command: DeepyCommand, plan: LaunchPlan) -> SaveLock | None:
    """The lock of ``save`` for a launch that trains into it (megatron/launcher/save_lock.py); None for one
    that does not write there (generate.py, eval.py), has no ``save``, or is an in-place task other than
    rank 0's. Another run holding it is a config error naming it."""
    save = local_save(resolved)
    if not save or os.path.basename(command.user_script) in ENTRY_POINTS_OF_TEXTGEN:
        return None
    if plan.in_place and current_rank() not in (0, None):
        return None
    holder = this_process(shlex.join([os.path.basename(sys.executable), "deepy.py", *sys.argv[1:]]),
                          resolved.run_name or "", resolved.directory or "")
    return lock_save(resolved, save, holder)


def lock_save(resolved: ResolvedConfig, save: str, holder: Holder,
              takes_over: Callable[[Holder], bool] | None = None) -> SaveLock:
    """Take ``save``'s lock for ``holder`` (``save_lock.acquire``, ``takes_over`` as there); another run holding it
    is a config error naming ``save`` where the config set it; a stale lock taken over is said."""
    try:
        lock, note = acquire(save, holder, takes_over=takes_over)
    except SaveDirInUse as busy:
        shown = RuleContext(args=resolved.args, provenance=resolved.provenance).show("save")
        raise ConfigError(f"{shown}: {busy.describe()}: wait for it to end or stop it, or save this run "
                          f"elsewhere") from None
    if note is not None:
        print(f"deepy: note: {note}", flush=True)
    return lock


def save_lock_note(resolved: ResolvedConfig, user_script: str) -> str | None:
    """What a dry run says when another run holds ``save`` (a launch would be refused; the dry run is not)."""
    save = local_save(resolved)
    if not save or os.path.basename(user_script) in ENTRY_POINTS_OF_TEXTGEN or not os.path.isdir(save):
        return None
    held = current_holder(save)
    if held is None:
        return None
    holder, why = held
    who = holder.describe() if holder is not None else "another run"
    return f"save={save} is in use by {who} ({why}): a launch now would be refused"


def main(argv: Sequence[str] | None = None) -> int:
    command = parse_command(sys.argv[1:] if argv is None else argv)
    resolved = resolve(command, world=command.rehearse)
    if command.verbose and "deepspeed_log_level" not in resolved.provenance:
        resolved.args.deepspeed_log_level = "info"  # --verbose/--debug show DeepSpeed's own INFO lines too
        resolved.provenance["deepspeed_log_level"] = "cli"
    if command.rehearse is not None:  # nothing is launched, with or without --dry-run
        # lazy: the rehearsal imports torch and DeepSpeed; every other command runs without them
        from megatron.app.rehearsal import rehearse

        given = " ".join([*command.config_files, *command.overrides, *(f.text for f in command.dialect_flags)])
        return rehearse(resolved, command.user_script, given, command.rehearse, check_memory,
                        notes(resolved, command.user_script))
    finished = already_finished(resolved, command.user_script)
    if finished is not None and not command.dry_run:
        # nothing is launched, so no rank re-runs the final evaluations or logs their rows again
        print(f"deepy: {finished}", flush=True)
        return 0
    if finished is not None:
        resolved.warnings.append(f"{finished}; a launch would exit at once")
    fit = memory_fit(resolved)
    check_memory(resolved, fit, command.user_script)
    run_dir = assign_run_dir(resolved, command.user_script)
    config_path = os.path.join(run_dir, RESOLVED_FILE_NAME)
    try:
        plan: LaunchPlan | None = plan_run(resolved, command.user_script, config_path)
    except ConfigError as err:
        # checking a launch:slurm config on a login node: the allocation exists only inside sbatch/salloc
        if not (command.dry_run and resolved.args.launcher == "slurm" and "SLURM_JOB_ID" not in os.environ):
            raise
        resolved.skipped.append(f"the srun command: {err.message}")
        plan = None
    if plan is not None:
        restarts.check_restartable(plan, resolved.args.max_restarts,
                                   RuleContext(args=resolved.args, provenance=resolved.provenance).show("max_restarts"))
    if command.dry_run:
        held = save_lock_note(resolved, command.user_script)
        if held is not None:
            resolved.warnings.append(held)
        print(render_dry_run(resolved, command, plan, fit))
        return 0
    assert plan is not None, "only a dry run goes on without a launch plan"
    lock = take_save_lock(resolved, command, plan)  # before anything is written into save or the run directory
    try:
        code = launch(resolved, command, plan, config_path, fit)
    finally:
        if lock is not None:
            lock.release()
    return requeue_if_stopped(resolved, command, plan, code)  # after the lock: the requeued job takes it again


def launch(resolved: ResolvedConfig, command: DeepyCommand, plan: LaunchPlan, config_path: str, fit: MemoryFit) -> int:
    """Write the resolved config and run the launch to its end (the ``save`` lock held)."""
    for line in notes(resolved, command.user_script):
        print(f"deepy: {line}", flush=True)
    if resolved.args.initialize_from_hf:
        started = hf_start(resolved, in_place=plan.in_place)
        print(f"deepy: {started}", flush=True)
    config_file = resolved.write(config_path)
    print(f"deepy: resolved config written to {config_file}", flush=True)

    if not plan.in_place:  # in place, every rank's deepy.py would clear the others'
        # a resumed run's directory may hold the errors of its last launch
        rank_errors.clear(os.path.dirname(config_path))


    policy = restarts.RestartPolicy(resolved.args.max_restarts, os.path.dirname(config_path),
                           lambda: last_checkpoint(resolved))  # fmt: skip
    return restarts.run_with_restarts(plan, lambda: plan_run(resolved, command.user_script, config_path), os.environ,
                                      policy, verbose=is_verbose(resolved.args.deepspeed_log_level), memory=fit.note(),
                                      trains=os.path.basename(command.user_script) not in ENTRY_POINTS_OF_TEXTGEN)


def starting_point(load: str, iteration: int | None) -> tuple[Any, dict[str, Any]] | None:
    """The checkpoint a resume from ``load`` loads and its ``deepy_meta.json`` (``discovery.resume_point``; for a
    bucket, read there: ``remote.remote_resume_point``)."""
    if is_remote(load):
        return remote_resume_point(load, iteration)
    return resume_point(Path(load), iteration)


def local_save(resolved: ResolvedConfig) -> str | None:
    """``save`` on this machine: the directory itself, or for a bucket its staging directory (the ranks write there
    before uploading; the save lock and Slurm's requeue ledger live there)."""
    save = resolved.args.save
    return str(staging_dir(save, resolved.args.checkpoint_staging_dir)) if save and is_remote(save) else save


def local_load(resolved: ResolvedConfig) -> str | None:
    """``load`` on this machine, resolved (a bucket's: its staging directory)."""
    load = resolved.args.load
    if not load:
        return None
    if is_remote(load):
        return str(staging_dir(load, resolved.args.checkpoint_staging_dir).resolve())
    return str(Path(load).resolve())


def last_checkpoint(resolved: ResolvedConfig) -> str | None:
    """The newest committed checkpoint a relaunch resumes from, in words (``ckpt/global_step8 (step 8)``)."""
    load = resolved.args.load
    found = starting_point(load, None) if load and (is_remote(load) or os.path.isdir(load)) else None
    if found is None:
        return None
    ckpt, meta = found
    return f"{ckpt} (step {meta.get('iteration')})"


def requeue_if_stopped(resolved: ResolvedConfig, command: DeepyCommand, plan: LaunchPlan, code: int) -> int:
    """deepy's exit code, once a Slurm batch job whose ranks all stopped cleanly (they saved on a stop request) short
    of its last step has requeued itself when Slurm's time limit or a preemption stopped it
    (``slurm_requeue``, megatron/launcher/requeue.py). Anything else keeps ``code``."""
    args = resolved.args
    if code != 0 or plan.mode != "srun" or plan.in_place or not args.slurm_requeue or not args.save:
        return code
    if os.path.basename(command.user_script) in ENTRY_POINTS_OF_TEXTGEN:
        return code
    if already_finished(resolved, command.user_script) is not None:
        return code
    save = Path(local_save(resolved) or args.save).resolve()
    if not args.load or not args.load_checkpoint or args.finetune or local_load(resolved) != str(save):
        print(f"deepy: not requeued: a requeued job resumes from `load`, which is not `save` ({args.save}); submit "
              f"again with load={args.save} to resume", flush=True)  # fmt: skip
        return code
    found = resume_point(save)
    step = found[1].get("iteration") if found is not None else 0
    name = resumed_run_name(resolved, command.user_script) or resolved.run_name
    metrics = Path(args.log_dir, name, "metrics.jsonl") if args.log_dir and name else None

    return requeue_after_stop(environ=os.environ, save=save, step=step if isinstance(step, int) else 0,
                              max_without_progress=args.max_requeues_without_progress, metrics=metrics,
                              say=lambda line: print(f"deepy: {line}", flush=True))
