"""GraphedVerify.compile_verification: greedy verification runs once per captured verify length (with
and without caps) at start-up, so a host drafter's first drafting steps compile nothing (on the
H200 a suffix engine compiled 4 kernels in its first drafting steps after the warm-up); so does the
advance of a verify's inputs to the next one's (adaptive speculation compiled it for 3 and 4 rows in
serving on the H200)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from foretell.runner import verify_warm_up
from foretell.runner.graphed_verify import GraphedVerify


def _graphs(keys, captures=True):
    rows = 4 * 17
    outputs = {key: SimpleNamespace(greedy=torch.arange(rows, dtype=torch.int64)) for key in keys}
    return SimpleNamespace(graphs=outputs, input_ids=torch.zeros(rows, dtype=torch.int64), captures=captures,
                           device=torch.device("cpu"), block_size=16)


def _verify(graphs, synthetic=False):
    loop = SimpleNamespace(accepted=torch.zeros(4, dtype=torch.int64), next_token=torch.zeros(4, dtype=torch.int64),
                           num_live=torch.zeros((), dtype=torch.int64), k=16)
    verify = GraphedVerify.__new__(GraphedVerify)  # the fields compile_verification reads
    verify.graphs, verify.draft_graphs = graphs, loop
    verify.verifier = SimpleNamespace(synthetic=synthetic)
    return verify


def test_each_verify_length_is_verified_with_and_without_caps(monkeypatch):
    calls = []

    def record(greedy, drafts, caps, accepted, next_token, num_live):
        calls.append((tuple(greedy.shape), tuple(drafts.shape), drafts.stride(0), caps is None))

    monkeypatch.setattr(verify_warm_up, "accept_drafts", record)
    _verify(_graphs([(1, 1), (4, 1), (1, 5), (4, 5), (1, 9), (1, 17)])).compile_verification()
    assert calls == [((1, q), (1, q - 1), q, caps_none) for q in (5, 9, 17) for caps_none in (True, False)]


def test_the_real_kernel_twin_runs_and_writes_only_the_loop_buffers():
    verify = _verify(_graphs([(1, 5), (2, 17)]))
    verify.compile_verification()  # the torch twin on the CPU: shapes and arguments as on the GPU
    assert int(verify.draft_graphs.num_live) == 1


def test_each_verify_length_advances_once_on_its_own_buffers(monkeypatch):
    calls = []

    def record(input_ids, positions, slot_mapping, seq_lens, table, accepted, next_token, drafts, block_size):
        rows = (input_ids, positions, slot_mapping)
        assert len({t.data_ptr() for t in rows}) == 3 and all(t.storage_offset() == 0 for t in rows)  # aligned alike
        calls.append((input_ids.numel(), tuple(drafts.shape), tuple(table.shape), block_size))

    monkeypatch.setattr(verify_warm_up, "advance_verify_inputs", record)
    for synthetic in (False, True):  # a drawn verifier's steps advance too
        calls.clear()
        _verify(_graphs([(1, 1), (4, 3), (1, 4), (2, 4)]), synthetic=synthetic).compile_verification()
        assert calls == [(3, (1, 2), (1, 1), 16), (4, (1, 3), (1, 1), 16)]  # q // 16 + 1 blocks


def test_the_advance_twin_runs_on_the_cpu():
    _verify(_graphs([(1, 3), (1, 16), (1, 17)])).compile_verification()  # positions up to 17: two blocks


def test_nothing_runs_without_captured_graphs_and_no_verification_with_a_drawn_verifier(monkeypatch):
    fail = lambda *a: (_ for _ in ()).throw(AssertionError("ran"))  # noqa: E731
    monkeypatch.setattr(verify_warm_up, "accept_drafts", fail)
    _verify(_graphs([(1, 5)]), synthetic=True).compile_verification()
    monkeypatch.setattr(verify_warm_up, "advance_verify_inputs", fail)
    _verify(_graphs([(1, 5)], captures=False)).compile_verification()
