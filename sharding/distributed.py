"""Multi-host initialisation, behind a flag: one process per host, all GPUs of all hosts in one mesh."""
from __future__ import annotations

from absl import flags, logging

import jax

_COORD = flags.DEFINE_string("coordinator_address", None,
                             "host:port of process 0 for multi-host meshes; unset = single host.")
_NPROC = flags.DEFINE_integer("num_processes", 1, "Number of processes (hosts) in a multi-host mesh.")
_PID = flags.DEFINE_integer("process_id", 0, "This process's index in [0, num_processes).")


def maybe_initialize() -> bool:
    """Calls jax.distributed.initialize when --coordinator_address is set; returns whether it did."""
    if not _COORD.value:
        return False
    if not 0 <= _PID.value < _NPROC.value:
        raise ValueError(f"--process_id ({_PID.value}) must be in [0, --num_processes={_NPROC.value})")
    jax.distributed.initialize(coordinator_address=_COORD.value, num_processes=_NPROC.value,
                               process_id=_PID.value)
    logging.info("jax.distributed: process %d of %d, %d global devices", jax.process_index(),
                 jax.process_count(), jax.device_count())
    return True
