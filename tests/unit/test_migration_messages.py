"""The migration's control-plane messages: bodies checked on
arrival, and the messenger that waits for one by key."""

from __future__ import annotations

import logging

import pytest
import torch

from vpipe.control.messages import Message, make
from vpipe.migration.messages import MIGRATION_TYPES, ControlMessenger
from vpipe.migration.state import pack_layer

MANIFEST = pack_layer(3, torch.nn.Linear(2, 2), None).manifest


@pytest.mark.parametrize("type_, body, message", [
    ("migrate_ready", [0, 1], "body must be a map, got list"),
    ("migrate_ready", {"round": 0}, "body keys ['round'] do not match ['move', 'round']"),
    ("migrate_ready", {"round": 0, "move": 1, "extra": 2},
     "body keys ['extra', 'move', 'round'] do not match"),
    ("migrate_ack", {"round": 1 << 17, "move": 1}, "round must be an integer in [0, 65536], got 131072"),
    ("migrate_ack", {"round": 0, "move": True}, "move must be an integer in [0, 262144], got True"),
    ("migrate_transfer", {"round": 0, "move": 1, "nbytes": -1}, "nbytes must be an integer in [0, "),
    ("migrate_abort", {"round": 0, "move": 1, "reason": "x" * 201}, "abort reason must be a short string"),
    ("migrate_abort", {"round": 0, "move": 1, "reason": 5}, "abort reason must be a short string"),
    ("migrate_prepare", {"round": 0, "move": 1, "src": 0, "dst": 1, "layers": [], "manifests": []},
     "layers must be a list of 1..4096 ids"),
    ("migrate_prepare", {"round": 0, "move": 1, "src": 0, "dst": 1, "layers": [3, 4],
                         "manifests": [MANIFEST]},
     "prepare needs one manifest per layer"),
    ("migrate_prepare", {"round": 0, "move": 1, "src": 0, "dst": -1, "layers": [3], "manifests": [MANIFEST]},
     "dst must be an integer in [0, 65536], got -1"),
    ("migrate_prepare", {"round": 0, "move": 1, "src": 0, "dst": 1, "layers": ["3"], "manifests": [MANIFEST]},
     "layer id must be an integer in [0, 2147483648], got '3'"),
    ("migrate_prepare", {"round": 0, "move": 1, "src": 0, "dst": 1, "layers": [3],
                         "manifests": [dict(MANIFEST, layer=-3)]}, "layer manifest has a bad layer id -3"),
    ("migrate_handover", {"round": 0, "move": 1, "manifests": []}, "handover needs a list of manifests"),
])
def test_bad_bodies_are_refused_naming_the_fault(type_, body, message):
    with pytest.raises(ValueError) as err:
        MIGRATION_TYPES[type_](body)
    assert str(err.value).startswith(message), str(err.value)


def test_good_bodies_pass_unchanged():
    prepare = {"round": 2, "move": 3, "src": 1, "dst": 2, "layers": [3], "manifests": [MANIFEST]}
    assert MIGRATION_TYPES["migrate_prepare"](prepare) is prepare
    assert MIGRATION_TYPES["migrate_abort"]({"round": 0, "move": 0, "reason": ""}) == {"round": 0, "move": 0,
                                                                                      "reason": ""}


class FakePlane:
    """A control plane whose inbox the test fills; ``poll`` returns the messages of the asked types."""

    def __init__(self, accept: bool = True) -> None:
        self.inbox: list[Message] = []
        self.sent: list[tuple[int, Message]] = []
        self.accept = accept
        self.polls = 0

    def send(self, peer: int, message: Message) -> bool:
        self.sent.append((peer, message))
        return self.accept

    def poll(self, timeout_ms: int = 0, *, types=None) -> list[Message]:
        self.polls += 1
        out = [m for m in self.inbox if types is None or m.type in types]
        self.inbox = [m for m in self.inbox if m not in out]
        return out


def _msg(type_: str, src: int, epoch: int, round_: int, move: int) -> Message:
    return make(type_, {"round": round_, "move": move}, epoch=epoch, stage=src)


def test_messages_go_out_from_this_rank_and_a_full_queue_is_logged(caplog):
    plane = FakePlane()
    ControlMessenger(plane, rank=2).send_to(3, "migrate_ready", {"round": 1, "move": 5}, epoch=7)
    peer, msg = plane.sent[0]
    assert (peer, msg.type, msg.src, msg.stage, msg.epoch, msg.body) == (3, "migrate_ready", 2, 2, 7,
                                                                         {"round": 1, "move": 5})
    with caplog.at_level(logging.WARNING, logger="vpipe.migration"):
        ControlMessenger(FakePlane(accept=False), rank=2).send_to(3, "migrate_ack", {"round": 1, "move": 5},
                                                                  epoch=7)
    assert "rank 2: could not queue migrate_ack for rank 3" in caplog.text


def test_a_wait_takes_its_own_message_and_keeps_the_others_for_their_waiters():
    plane = FakePlane()
    messenger = ControlMessenger(plane, rank=1)
    plane.inbox = [_msg("migrate_prepare_other", 0, 4, 0, 1),  # not a migration type: never taken here
                   _msg("migrate_ready", 0, 4, 0, 5),  # another move of the same round
                   _msg("migrate_ready", 2, 4, 0, 1),  # the same key from another rank
                   _msg("migrate_ack", 0, 4, 0, 1),  # another type
                   _msg("migrate_ready", 0, 4, 0, 1)]
    assert messenger.wait_for({"migrate_ready"}, from_rank=0, key=(4, 0, 1), timeout_s=1.0) == (
        "migrate_ready", {"round": 0, "move": 1})
    polls = plane.polls
    assert messenger.wait_for({"migrate_ready", "migrate_abort"}, from_rank=0, key=(4, 0, 5),
                              timeout_s=1.0)[1] == {
        "round": 0, "move": 5}
    assert messenger.wait_for({"migrate_ready"}, from_rank=2, key=(4, 0, 1), timeout_s=1.0) is not None
    assert messenger.wait_for({"migrate_ack"}, from_rank=0, key=(4, 0, 1), timeout_s=1.0) is not None
    assert plane.polls == polls  # held since the first wait: no polling needed
    assert [m.type for m in plane.inbox] == ["migrate_prepare_other"] and messenger.stale == 0
    # taken once
    assert messenger.wait_for({"migrate_ready"}, from_rank=0, key=(4, 0, 1), timeout_s=0.05) is None


def test_messages_of_rounds_that_ended_are_dropped_as_stale():
    plane = FakePlane()
    messenger = ControlMessenger(plane, rank=1)
    plane.inbox = [_msg("migrate_ack", 0, 3, 9, 1),  # an older epoch
                   _msg("migrate_ready", 0, 4, 0, 1),  # an earlier round of this epoch
                   _msg("migrate_ready", 0, 4, 1, 3),  # this round, another move: kept
                   _msg("migrate_ready", 0, 5, 0, 1)]  # a later epoch: kept
    assert messenger.wait_for({"migrate_ready"}, from_rank=0, key=(4, 1, 1), timeout_s=0.05) is None
    assert messenger.stale == 2
    assert messenger.wait_for({"migrate_ready"}, from_rank=0, key=(4, 1, 3), timeout_s=1.0) is not None
    assert messenger.wait_for({"migrate_ready"}, from_rank=0, key=(5, 0, 1), timeout_s=1.0) is not None
    assert messenger.wait_for({"migrate_ack"}, from_rank=0, key=(3, 9, 1), timeout_s=0.05) is None  # gone
