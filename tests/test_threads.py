"""Threads from the free cores: the command line sets them, oneshot says how."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from seqcal.backend.threads import THREAD_VARIABLES, choose_threads, free_cores, hint_threads


def test_free_cores_leave_the_busy_ones() -> None:
    assert free_cores(load=1.0, cores=2, machine=2) == 2  # only this process: an idle machine
    assert free_cores(load=5.6, cores=8, machine=8) == 3
    assert free_cores(load=19.0, cores=2, machine=2) == 1  # never below one
    assert (
        free_cores(load=10.0, cores=4, machine=64) == 4
    )  # an affinity smaller than the machine's free cores


@pytest.fixture
def busy(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two cores for this process, both kept busy by others; torch's threads restored afterwards."""
    for name in THREAD_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(os, "getloadavg", lambda: (19.0, 19.0, 19.0))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_the_command_line_keeps_the_threads_unless_told(busy: None, caplog: pytest.LogCaptureFixture) -> None:
    """Bytes depend on the thread count: a busy machine never changes it by itself, it only says how (-v)."""
    torch.set_num_threads(2)
    with caplog.at_level(logging.DEBUG, logger="seqcal"):
        assert choose_threads() == 2 and torch.get_num_threads() == 2
    assert "1 of 2 cores free (load average 19.0)" in caplog.text and "--threads 1" in caplog.text
    assert choose_threads(1) == 1  # --threads wins


def test_a_user_choice_is_kept_and_oneshot_only_says_how(
    busy: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    torch.set_num_threads(2)
    with caplog.at_level(logging.DEBUG, logger="seqcal"):
        hint_threads()
    assert torch.get_num_threads() == 2 and "torch.set_num_threads(1) before oneshot" in caplog.text
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert choose_threads() == 2
