"""TCPStore servers of ours (where rebuilt communicators meet), listening on the address given only.
torch's TCPStore server listens on every interface; handed a socket bound to one address, it listens
there alone."""
from __future__ import annotations

import datetime
import socket

import torch.distributed as dist


def serve(host: str, port: int = 0, world_size: int | None = None,
          timeout: datetime.timedelta = datetime.timedelta(seconds=300)) -> "dist.TCPStore":
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(addr)
    sock.listen(1024)
    bound = sock.getsockname()[1]
    return dist.TCPStore(host, bound, world_size, True, timeout=timeout, wait_for_workers=False,
                         master_listen_fd=sock.detach())
