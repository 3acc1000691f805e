"""Debug hooks that let tests put a run into a known bad place: a planted NaN, a block to be killed at."""

from __future__ import annotations

import os
import sys
import time

from state.train_state import RolloutBuffer

BLOCK_MARKER = "debug: blocked at"


def block_at(spec: str, point: str, step: int) -> None:
    """When --debug_block_at == f"{point}:{step}": say so on stderr and sleep until killed."""
    if spec != f"{point}:{step}":
        return
    sys.stderr.write(f"{BLOCK_MARKER} {point}:{step} (pid {os.getpid()}); waiting to be killed\n")
    sys.stderr.flush()
    while True:
        time.sleep(3600)


def plant_nan(buf: RolloutBuffer) -> RolloutBuffer:
    """A copy whose first sample's advantages are NaN: the loss and every gradient become NaN."""
    adv = buf.advantages.clone()
    adv[0] = float("nan")
    return buf._replace(advantages=adv)
