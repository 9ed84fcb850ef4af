"""Ending this process: at once, without interpreter shutdown (flush what was written, end the
checkpoint writer's helper process, and go: ``os._exit``), or at the end of a job."""
from __future__ import annotations

import logging
import multiprocessing
import os
import sys


def exit_now(code: int) -> None:
    for child in multiprocessing.active_children():  # e.g. the checkpoint writer's manager
        child.terminate()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    logging.shutdown()
    os._exit(code)


def end_of_job() -> int:
    """A worker's end after its last step: the job's last barrier, then its groups torn down. A
    communicator replaced by a recovery may still be being released: a collective abandoned by a stop
    can wait for a peer that is gone until its timeout. Tearing the other groups down (or the
    interpreter's own shutdown) under it can abort the process, which has nothing left to do: it
    ends at once instead."""
    import torch.distributed as dist
    from mindspeed_ha.comm import groups
    if dist.is_initialized():
        dist.barrier()
        if groups.releasing():
            exit_now(0)
        dist.destroy_process_group()
    if not groups.released(timeout=10.0):
        exit_now(0)
    return 0
