"""What the launcher reads from a run's config: hosts, ranks per node, rendezvous, how ranks start.

One frozen record built once from the user's arguments (:meth:`LaunchConfig.from_args`), so the
launcher never reaches into the flat argument object and every default stays in the schema
(``megatron/neox_arguments/groups/deepspeed_runner.py`` and ``other.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from megatron.neox_arguments.arguments import NeoXArgs

LauncherName = Literal["pdsh", "openmpi", "mvapich", "mpich", "slurm"]


@dataclass(frozen=True, kw_only=True, slots=True)
class LaunchConfig:
    """The launch-related keys of one run (GPT-NeoX names)."""

    launcher: LauncherName = "pdsh"
    """How ranks start: DeepSpeed's runner (``pdsh``), ``mpirun`` (openmpi/mpich/mvapich) or ``srun``."""
    hostfile: str | None = None
    """``<host> slots=<n>`` lines; ``None`` means this machine (or the Slurm allocation)."""
    include: str = ""
    """DeepSpeed's ``NAME[:SLOT,...]@...`` filter ('' = no filter)."""
    exclude: str = ""
    num_nodes: int = -1
    """Keep the first N hosts; -1 keeps all."""
    num_gpus: int | None = None
    """Ranks per host; ``None`` means the host's slot (device) count."""
    master_addr: str | None = None
    master_port: int = 29500
    master_port_given: bool = False
    """Whether the user chose ``master_port`` (else a free port is picked where the launch is local)."""
    force_multi: bool = False
    no_ssh_check: bool = False
    comment: str | None = None
    """Passed to ``srun --comment``."""
    account: str | None = None
    """Passed to ``srun --account``."""
    deepspeed_slurm: bool = False
    """Ranks read their place from Slurm's variables first; deepy inside ``srun`` runs the worker in place."""
    deepspeed_mpi: bool = False
    """deepy inside ``mpirun`` runs the worker in place."""
    deepspeed_log_level: str = "warning"
    """Log level of DeepSpeed's runner and per-node launcher (``--debug`` sets info)."""

    @classmethod
    def from_args(cls, args: NeoXArgs, provenance: Mapping[str, str] | None = None) -> LaunchConfig:
        """The launch keys of ``args``; ``provenance`` tells whether ``master_port`` was chosen.

        Without a provenance entry (tests and programmatic callers build args directly) a
        ``master_port`` other than the schema default counts as chosen, as in the config rules.
        """
        from megatron.neox_arguments.arguments import NeoXArgs
        from megatron.config_rules import DERIVED
        from megatron.neox_arguments.provenance import field_default

        source = (provenance or {}).get("master_port")
        if source is None:
            port_given = args.master_port != field_default(NeoXArgs, "master_port")
        else:
            port_given = source != DERIVED
        return cls(
            launcher=args.launcher,
            hostfile=args.hostfile or None,
            include=args.include or "",
            exclude=args.exclude or "",
            num_nodes=-1 if args.num_nodes is None else int(args.num_nodes),
            num_gpus=args.num_gpus,
            master_addr=args.master_addr or None,
            master_port=int(args.master_port),
            master_port_given=port_given,
            force_multi=bool(args.force_multi),
            no_ssh_check=bool(args.no_ssh_check),
            comment=args.comment or None,
            account=args.account or None,
            deepspeed_slurm=bool(args.deepspeed_slurm),
            deepspeed_mpi=bool(args.deepspeed_mpi),
            deepspeed_log_level=args.deepspeed_log_level,
        )
