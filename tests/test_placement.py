"""serve/placement.py without an engine: rows, the block-table rows its plans hand the runner, buckets."""

from kivi_serve.placement import Placement
from kivi_serve.request import Request
from kivi_serve.runner import RowPages


def request(tokens: int) -> Request:
    return Request(prompt_ids=list(range(tokens)), max_tokens=1, emit=lambda *a: None)


def test_a_request_back_in_its_old_row_with_as_many_new_pages_gets_its_new_block_table_row():
    # The block table row is rewritten when a request comes back, even into the same row with the
    # same number of pages (other ids): (request, count) alone would look unchanged.
    placement = Placement(RowPages(num_pages=12, page_size=4, max_pages_per_seq=3), slots=1, buckets=(1,))
    r = request(7)
    placement.rows[0] = r
    placement.blocks.allocate(r, 8)
    assert placement.table_update() == [(0, (0, 1))]
    assert placement.table_update() == []  # nothing changed since
    placement.leave(r)  # it leaves its row (as a preemption does): pages 0, 1 back to the pool
    placement.blocks.allocate("other", 12)  # the pool's next pages go elsewhere
    placement.rows[0] = r
    new = placement.blocks.allocate(r, 8)  # back with as many pages, other ids
    assert len(new) == 2 and new != [0, 1]
    assert placement.table_update() == [(0, tuple(new))]


def test_a_static_cache_admits_while_a_row_is_free_and_never_preempts():
    # runner.RowPages: one page of max_seq_len tokens per row, whatever the request's length.
    placement = Placement(RowPages(num_pages=2, page_size=64), slots=2, buckets=(2,))
    waiting = placement.waiting
    waiting.extend(request(n) for n in (60, 3, 5))
    plan = placement.plan()
    assert [p.row for p in plan.prefills] == [0, 1] and not plan.swap_out and len(waiting) == 1
    running = [r for _, r in placement.running()]
    for r in running:
        r.tokens = [1] * 3  # grows past its page? 60 + 3 tokens still fit one page of 64
    plan = placement.plan()
    assert not plan.prefills and not plan.swap_out and len(waiting) == 1
    placement.leave(running[1])
    plan = placement.plan()
    assert [p.row for p in plan.prefills] == [1] and not waiting
    placement.check()
    snap = placement.snapshot()
    assert snap["rows"] == [running[0].id, placement.rows[1].id] and snap["swapped"] == []


def test_compaction_moves_requests_into_the_lowest_rows_of_their_bucket():
    placement = Placement(RowPages(num_pages=6, page_size=64), slots=6, buckets=(2, 4, 6))
    placement.waiting.extend(request(4) for _ in range(5))
    placement.plan()
    assert placement.decode_batch() == ([0, 1, 2, 3, 4], 6)
    for slot in (0, 1, 2):
        placement.leave(placement.rows[slot])
    moves = placement.compaction()  # two requests left, in rows 3 and 4: bucket 2
    assert moves == [(3, 0), (4, 1)]
    assert placement.decode_batch() == ([0, 1], 2)
    placement.check()


def test_a_preempted_request_leaves_its_row_and_comes_back_into_a_free_one():
    placement = Placement(RowPages(num_pages=4, page_size=4, max_pages_per_seq=4), slots=2, buckets=(2,))
    placement.waiting.extend([request(7), request(7)])  # 2 pages each, with the first token: the pool
    assert [p.row for p in placement.plan().prefills] == [0, 1]
    first, second = placement.rows
    first.tokens = [1, 1]  # 9 tokens after the next step: a third page, and none is free
    plan = placement.plan()
    assert [(s.row, s.key) for s in plan.swap_out] == [(1, second.key)] and placement.rows == [first, None]
    assert second.preemptions == 1 and placement.snapshot()["swapped"] == [second.id]
    assert second.saved == len(plan.swap_out[0].pages)
    placement.leave(first)  # the older one finishes: its pages come back
    plan = placement.plan()
    assert [s.row for s in plan.swap_in] == [0] and placement.rows == [second, None]
    pages = plan.swap_in[0].pages
    assert len(pages) == 2 and dict(plan.table)[0][:2] == pages
    placement.check()
