"""Where a rank is (iteration, phase), in a small shared-memory file its launcher agent reads when
the rank dies: exact even for a SIGKILL between two heartbeats, and a few microseconds per update."""
from __future__ import annotations

import mmap
import os
import struct


class ProgressBoard:
    """Iteration and phase of a rank in a small shared-memory file the agent reads when the rank
    dies: exact even for a SIGKILL between two heartbeats, and a few microseconds per hook."""
    FMT = struct.Struct("<qq40s")  # iteration, sequence, phase

    def __init__(self, path: str, create: bool = True):
        self.path = path
        fd = os.open(path, os.O_RDWR | (os.O_CREAT if create else 0), 0o600)
        try:
            if create:
                os.ftruncate(fd, self.FMT.size)
            self.mm = mmap.mmap(fd, self.FMT.size)
        finally:
            os.close(fd)
        self.seq = 0

    def write(self, iteration: int, phase: str) -> None:
        self.seq += 1
        self.mm[:] = self.FMT.pack(int(iteration), self.seq, phase.encode()[:40])

    @classmethod
    def read(cls, path: str) -> tuple[int, str] | None:
        try:
            with open(path, "rb") as f:
                it, seq, ph = cls.FMT.unpack(f.read(cls.FMT.size))
        except (OSError, struct.error):
            return None
        return (it, ph.rstrip(b"\0").decode(errors="replace")) if seq else None


def board_path(rank: int) -> str | None:
    d = os.environ.get("MINDSPEED_HA_PROGRESS_DIR")
    return os.path.join(d, f"rank_{rank}") if d else None
