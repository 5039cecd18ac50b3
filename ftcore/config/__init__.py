"""The one typed configuration tree and its one loader.

* ``fields``: what a section is (typed fields, declared ranges, the one check);
* ``sections``: the sections of a run and the whole tree, ``Config``;
* ``health``: the node health sections the Slurm hooks read too;
* ``loader``: defaults -> TOML file -> ``FTL_*`` environment -> ``--set``, and
  the saver that writes the resolved config back as TOML.

Everything is importable from here (``from ft_launch.config import Config``).
"""

from .fields import MAX_SECONDS, MAX_STRING_CHARS, Bounds, GiB, MiB, field_bounds, string_problem
from .health import BACKENDS, HealthConfig, Tables
from .loader import (
    ENV_CONFIG,
    ENV_PREFIX,
    MAX_FILE_BYTES,
    apply_table,
    config_file,
    load_config,
    parse_config,
    save_config,
    to_toml,
)
from .sections import (
    SECTIONS,
    TABLE_SECTIONS,
    BatchHostRole,
    CkptConfig,
    Config,
    FtarConfig,
    IdenticalStart,
    JobConfig,
    LrScaling,
    PromotionPath,
    QuorumConfig,
    RecoveryConfig,
    RunConfig,
    RuntimeConfig,
    SlowPolicy,
    SlurmConfig,
    SpikePolicy,
    StandbyMode,
)

__all__ = [
    "BACKENDS",
    "ENV_CONFIG",
    "ENV_PREFIX",
    "MAX_FILE_BYTES",
    "MAX_SECONDS",
    "MAX_STRING_CHARS",
    "SECTIONS",
    "TABLE_SECTIONS",
    "BatchHostRole",
    "Bounds",
    "CkptConfig",
    "Config",
    "FtarConfig",
    "GiB",
    "HealthConfig",
    "IdenticalStart",
    "JobConfig",
    "LrScaling",
    "MiB",
    "PromotionPath",
    "QuorumConfig",
    "RecoveryConfig",
    "RunConfig",
    "RuntimeConfig",
    "SlowPolicy",
    "SlurmConfig",
    "SpikePolicy",
    "StandbyMode",
    "Tables",
    "apply_table",
    "config_file",
    "field_bounds",
    "load_config",
    "parse_config",
    "save_config",
    "string_problem",
    "to_toml",
]
