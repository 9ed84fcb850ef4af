"""Where a process runs, as the ranks tell it on the wire (``register``'s ``host``) and as the
controller compares it: the host name and, where Linux names it, the network namespace."""
from __future__ import annotations

import os
import socket


def this_host() -> str:
    """This process's host, as ``runs_here`` compares it: the host name and, where Linux names it,
    the network namespace. A process in another one is as far away as another host whatever its
    pid says (a node in a namespace of its own, a container sharing the host's pids): a cut link
    silences it while it runs on."""
    try:
        return f"{socket.gethostname()}/{os.readlink('/proc/self/ns/net')}"
    except OSError:
        return socket.gethostname()


def runs_here(pid: int, host: str) -> bool:
    """Process ``pid`` of ``host`` (as ``this_host`` named it there) runs on this host (not a zombie,
    not stopped: a stopped process is as silent as a lost one and must be treated as one)."""
    import psutil
    if not pid or host != this_host():
        return False
    try:
        return psutil.Process(pid).status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_STOPPED,
                                                    psutil.STATUS_DEAD)
    except psutil.Error:
        return False
