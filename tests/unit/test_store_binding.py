"""The rendezvous store of a run vpipe launches listens on loopback only, not on every interface."""

from __future__ import annotations

import psutil

from vpipe_lab.runtime.launch import host_store


def test_the_store_listens_on_loopback_only_and_works():
    store, listener = host_store("127.0.0.1", 1)
    try:
        listening = [c.laddr for c in psutil.Process().net_connections(kind="tcp")
                     if c.status == psutil.CONN_LISTEN and c.laddr.port == store.port]
        assert listening and all(addr.ip == "127.0.0.1" for addr in listening), listening
        store.set("vpipe/probe", "1")
        assert store.get("vpipe/probe") == b"1"
    finally:
        if listener is not None:
            listener.close()
