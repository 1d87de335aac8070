"""Where control sockets bind: loopback on one host, the rendezvous interface on several.

Binding to every interface would expose the control plane to the whole network, so the
default is the narrowest address that the peers can reach: ``127.0.0.1`` when the
rendezvous (``MASTER_ADDR``) is on loopback, else this host's address on the interface
that routes to ``MASTER_ADDR`` (found by connecting a UDP socket, which sends nothing).
``VPIPE_CONTROL_HOST`` (the settings' ``control_host``) overrides it explicitly; a wildcard
there (``0.0.0.0``) binds all interfaces but still advertises the routed address.
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
from collections.abc import Mapping

from vpipe.settings import WILDCARDS, process_settings

__all__ = ["control_host", "route_address", "check_endpoint", "tcp_endpoint", "is_loopback"]

_ENDPOINT = re.compile(r"^tcp://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]{1,253}):(\d{1,5})$")


def is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def route_address(remote: str, port: int = 9) -> str:
    """This host's address on the interface that routes to ``remote`` (no packet is sent)."""
    try:
        infos = socket.getaddrinfo(remote, port, type=socket.SOCK_DGRAM)
    except socket.gaierror as e:
        raise ValueError(f"cannot resolve the rendezvous address {remote!r}: {e}") from None
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.connect(addr)
        except OSError as e:
            raise ValueError(f"no route to the rendezvous address {remote!r}: {e}") from None
        return s.getsockname()[0]


def control_host(
    explicit: str | None = None, *, master_addr: str | None = None, environ: Mapping[str, str] | None = None
) -> tuple[str, str]:
    """(address to bind, address to advertise) for this process's control sockets.

    ``explicit`` (an attach passes its settings' ``control_host``; None: this process's settings', read once)
    wins; otherwise loopback or the address routing to ``master_addr`` (else ``MASTER_ADDR`` in ``environ``,
    default this process's: torchrun's rendezvous address, which torch.distributed reads too).
    """
    env = os.environ if environ is None else environ
    master = master_addr if master_addr is not None else env.get("MASTER_ADDR", "127.0.0.1")
    explicit = (explicit if explicit is not None else process_settings().control_host).strip()
    if explicit:
        if explicit in WILDCARDS:
            return explicit, ("127.0.0.1" if is_loopback(master) else route_address(master))
        try:
            ipaddress.ip_address(explicit)
        except ValueError:
            raise ValueError(f"VPIPE_CONTROL_HOST={explicit!r} is not an IP address of this "
                             f"host (or 0.0.0.0 for every interface)") from None
        return explicit, explicit
    if is_loopback(master):
        return "127.0.0.1", "127.0.0.1"
    address = route_address(master)
    return address, address


def tcp_endpoint(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def check_endpoint(text: object) -> tuple[str, int]:
    """(host, port) of a ``tcp://HOST:PORT`` endpoint; ValueError for anything else."""
    if not isinstance(text, str) or len(text) > 300:
        raise ValueError(f"an endpoint must be a string like tcp://127.0.0.1:5555, got {text!r:.80}")
    match = _ENDPOINT.match(text)
    if match is None:
        raise ValueError(f"an endpoint must look like tcp://HOST:PORT, got {text!r:.80}")
    port = int(match.group(2))
    if not 0 < port < 65536:
        raise ValueError(f"endpoint port {port} is out of range")
    return match.group(1).strip("[]"), port
