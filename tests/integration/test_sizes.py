"""One reading of byte sizes everywhere: decimal units are powers of 1000, binary ones of 1024."""

from __future__ import annotations

import pytest

from support.processes import run_vpipe
from vpipe import VpipeConfig
from vpipe.sizes import MAX_BYTES, parse_bytes


@pytest.mark.parametrize("text, value", [
    ("4096", 4096), ("16e9", 16 * 10**9), ("16GB", 16 * 10**9), ("16G", 16 * 10**9), ("16gb", 16 * 10**9),
    ("15GiB", 15 * 2**30), ("15Gi", 15 * 2**30), ("64M", 64 * 10**6), ("64MiB", 64 * 2**20), ("1.5 KB", 1500),
    ("2TiB", 2 * 2**40),
])
def test_sizes_read_the_same_way_everywhere(text, value):
    assert parse_bytes(text) == value
    assert VpipeConfig(memory_budget=text).memory_budget == value


@pytest.mark.parametrize("text, message", [
    ("-1", "must not be negative"), ("16 apples", "is not a byte size"), ("", "is not a byte size"),
    ("0", "must be at least 1 byte"), ("0.5", "must be at least 1 byte"), ("infG", "is not a byte size"),
    ("1e400", "larger than any machine"), ("1e400G", "larger than any machine"),
                                           ("9EiB", "is not a byte size"),
    (str(2 * MAX_BYTES), "larger than any machine"), ("1.5B", "is not a whole number of bytes"),
    ("1.5", "is not a whole number of bytes"),
])
def test_sizes_that_are_no_sizes_get_one_line(text, message):
    with pytest.raises(ValueError, match=message):
        parse_bytes(text)


def test_train_and_plan_refuse_a_bad_size_with_the_same_words_and_no_traceback():
    train = run_vpipe("train", "--memory-budget", "1e400G", timeout=60)
    plan = run_vpipe("plan", "x.json", "--stages", "2", "--memory-budget", "infG", timeout=60)
    assert train.returncode == plan.returncode == 2
    assert "Traceback" not in train.stderr + plan.stderr
    assert train.stderr.strip().splitlines()[-1] == ("vpipe train: error: argument --memory-budget: memory "
                                                     "budget '1e400G' is larger than any machine "
                                                     "(4611686018427387904 bytes at most)")
    assert plan.stderr.strip() == ("vpipe: error: memory budget 'infG' is not a byte size "
                                   "(examples: 16000000000, 16e9, 16GB, 15GiB, 512M)")
