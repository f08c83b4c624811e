"""Where the ranks of a torch.distributed group meet: a rendezvous (a name, an address and port,
the rank that hosts the store), the store it opens (a file store on one machine, a TCP store
across machines), and the network interface that holds a node's address (for gloo)."""

import contextlib
import glob
import os
import re
import socket
import tempfile
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist


@dataclass(frozen=True, slots=True)
class Rendezvous:
    """Where a group's ranks meet: a name unique to this forming of the group (the file of a
    file store, on one machine), the address and port of a TCP store (across machines), and the
    group rank whose process hosts that store."""

    name: str
    addr: str
    port: int
    owner: int = 0

    @property
    def file(self) -> str:
        return f"{tempfile.gettempdir()}/epcluster-{self.name}"


def rendezvous_store(rdzv: Rendezvous, world_size: int, rank: int, timeout_s: float) -> dist.Store:
    """On one machine (a loopback address) a file store, which listens on no port. Across
    machines a TCP store whose server listens on the address it publishes alone (not on every
    interface, as a store given only a port would)."""
    if uses_file_store(rdzv):
        return dist.FileStore(rdzv.file, world_size)
    timeout = timedelta(seconds=timeout_s)
    if rank != rdzv.owner:
        return dist.TCPStore(rdzv.addr, rdzv.port, world_size, is_master=False, timeout=timeout)
    listener = socket.create_server((rdzv.addr, rdzv.port), family=_family(rdzv.addr), backlog=128)
    return dist.TCPStore(
        rdzv.addr,
        rdzv.port,
        world_size,
        is_master=True,
        timeout=timeout,
        master_listen_fd=listener.detach(),
        use_libuv=False,
    )


def uses_file_store(rdzv: Rendezvous) -> bool:
    return rdzv.addr.startswith("127.")


def remove_store_files(rdzv: Rendezvous, earlier_only: bool = False) -> None:
    """Remove the file store of `rdzv` (a group that stopped), or with earlier_only the files of
    the same group's earlier formings but not its own (the owner calls it once its group formed:
    ranks killed by SIGKILL never remove theirs). Nothing for a TCP store."""
    if not uses_file_store(rdzv):
        return
    if not earlier_only:
        paths = [rdzv.file]
    else:  # "<cluster>-<pool>-g<generation>-<id>" or "<cluster>-kv-<id>": same group, any forming
        group = re.sub(r"-g\d+$", "", rdzv.name.rpartition("-")[0])
        paths = [p for p in glob.glob(glob.escape(rdzv.file[: -len(rdzv.name)] + group) + "-*")
                 if p != rdzv.file]  # fmt: skip
    for path in paths:
        with contextlib.suppress(OSError):
            os.remove(path)


def interface_of(addr: str) -> str | None:
    """The name of the network interface that holds IPv4 address `addr` (Linux), or None."""
    import fcntl
    import struct

    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                req = struct.pack("256s", name.encode()[:15])
                got = socket.inet_ntoa(fcntl.ioctl(s.fileno(), siocgifaddr, req)[20:24])
            except OSError:  # no IPv4 address on it
                continue
            if got == addr:
                return name
    return None


def _family(addr: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in addr else socket.AF_INET
