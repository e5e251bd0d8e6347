"""Window slots follow the model runner's requests: finished and preempted ones are freed, a new
engine in the same process starts from an empty map (its predecessor's last finished ids never arrive)."""

from types import SimpleNamespace

import pytest

from kivi_vllm.windows import WindowSlots


def _runner(*req_ids):
    return SimpleNamespace(input_batch=SimpleNamespace(req_ids=list(req_ids)))


def _out(*finished, preempted=None):
    return SimpleNamespace(finished_req_ids=set(finished), preempted_req_ids=preempted)


def _rows(slots):
    rows, fresh = slots.rows(2)
    return rows.tolist(), fresh


def test_slots_are_freed_and_reused():
    slots = WindowSlots()
    slots.reserve(2)
    runner = _runner("a", "b")
    slots.on_update(runner, _out())
    assert _rows(slots) == ([0, 1], [0, 1])  # (slots, the batch rows new to a slot)
    assert _rows(slots) == ([0, 1], [])
    runner.input_batch.req_ids = ["b", "c"]
    with pytest.raises(RuntimeError, match="no free KIVI window slot for request c"):
        slots.rows(2)
    slots.on_update(runner, _out("a"))
    assert _rows(slots) == ([1, 0], [1])


def test_a_new_engine_starts_empty():
    slots = WindowSlots()
    slots.reserve(2)
    slots.on_update(_runner("a", "b"), _out())
    slots.rows(2)
    slots.reserve(2)
    slots.on_update(_runner("c", "d"), _out())
    assert _rows(slots) == ([0, 1], [0, 1])


def test_a_preempted_request_frees_its_slot_while_it_waits():
    # vLLM bounds running requests by --max-num-seqs, not preempted ones waiting in its queue
    slots = WindowSlots()
    slots.reserve(2)
    runner = _runner("a", "b")
    slots.on_update(runner, _out())
    assert _rows(slots) == ([0, 1], [0, 1])
    runner.input_batch.req_ids = ["a", "c"]
    slots.on_update(runner, _out(preempted={"b"}))
    assert _rows(slots) == ([0, 1], [1])
