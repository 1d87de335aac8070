"""How many bytes this end has sent on a TCP connection, as the kernel counts them (Linux ``TCP_INFO``).

An inbox's doorman reads it on its connections: what an inbox sends during a ZMTP handshake
says how far the handshake went (its signature, its greeting, CURVE's WELCOME, then READY,
which goes only after the ZAP handler admitted the peer), with no help from zmq, whose socket
monitor names no connection when a handshake succeeds.
"""

from __future__ import annotations

import socket
import struct

__all__ = ["bytes_sent"]

# struct tcp_info (linux/tcp.h): __u64 tcpi_bytes_acked after 120 bytes of older fields (Linux 4.1 and later)
_BYTES_ACKED = struct.Struct("=Q")
_OFFSET = 120
_ASK = 256  # the kernel copies min(asked, its struct's size)


def bytes_sent(sock: socket.socket) -> int | None:
    """Bytes sent on ``sock`` and acknowledged by its peer; None where the kernel does not say (not Linux)."""
    option = getattr(socket, "TCP_INFO", None)
    if option is None:
        return None
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, option, _ASK)
    except OSError:
        return None
    if len(info) < _OFFSET + _BYTES_ACKED.size:
        return None
    return int(_BYTES_ACKED.unpack_from(info, _OFFSET)[0])
