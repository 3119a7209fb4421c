"""device_util.graph_capture holds Python's garbage collector off while a CUDA graph is captured
(a collection then could free another engine's graphs mid-capture and invalidate it) and restores
it afterwards, also when the capture raises. torch.cuda.graph is replaced by a recorder here: no
GPU is needed to check the collector's state around it."""

from __future__ import annotations

import contextlib
import gc

import pytest
import torch

from foretell.device_util import graph_capture


@pytest.fixture
def recorded_capture(monkeypatch):
    seen = []

    @contextlib.contextmanager
    def fake_graph(graph, pool=None):
        seen.append(("enter", gc.isenabled(), graph, pool))
        yield
        seen.append(("exit", gc.isenabled()))

    monkeypatch.setattr(torch.cuda, "graph", fake_graph)
    return seen


def test_the_collector_is_off_during_capture_and_back_after(recorded_capture):
    assert gc.isenabled()
    with graph_capture("g", pool="p"):
        assert not gc.isenabled()
    assert gc.isenabled()
    assert recorded_capture == [("enter", False, "g", "p"), ("exit", False)]


def test_a_failed_capture_restores_the_collector(recorded_capture):
    with pytest.raises(RuntimeError, match="capture failed"):
        with graph_capture("g"):
            raise RuntimeError("capture failed")
    assert gc.isenabled()


def test_a_collector_already_off_stays_off(recorded_capture):
    gc.disable()
    try:
        with graph_capture("g"):
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
