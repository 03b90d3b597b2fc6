"""Decode attention's blocks of slots and the sorting rule (streaming/generation/blocks.py): pure
arithmetic over lengths, checked against brute force (hypothesis) and by hand."""

import itertools

from hypothesis import given
from hypothesis import strategies as st

from streaming.generation.blocks import GRAIN, MOST_PIECES, Sorter, cuts, grain_of, pieces_by_rank


def cost_of(blocks, reads, call):
    return sum((b - a) * max(reads[a:b]) + call for a, b, _ in blocks)


def brute(reads, call):
    """The least cost over every way to cut at the grain's edges (slow: small n only)."""
    n = len(reads)
    grain = max(GRAIN, -(-n // MOST_PIECES))
    inner = list(range(grain, n, grain))
    best = float("inf")
    for k in range(len(inner) + 1):
        for chosen in itertools.combinations(inner, k):
            edges = [0, *chosen, n]
            best = min(
                best, sum((b - a) * top + call for a, b in itertools.pairwise(edges) if (top := max(reads[a:b])))
            )
    return best


@given(st.lists(st.integers(0, 400), min_size=1, max_size=20), st.sampled_from([0.0, 50.0, 330.0, 5000.0]))
def test_the_cuts_cost_the_least_of_every_way_to_cut_and_cover_every_slot_read(reads, call):
    blocks, cost = cuts(reads, call)
    assert cost == brute(reads, call) == cost_of(blocks, reads, call)
    covered = [i for a, b, _ in blocks for i in range(a, b)]
    assert covered == sorted(set(covered)) and all(i in covered for i, r in enumerate(reads) if r)
    assert all(top == max(reads[a:b]) > 0 for a, b, top in blocks)


def test_like_lengths_are_one_block_and_unlike_ones_are_cut_where_it_pays():
    assert cuts([200] * 64, 330.0)[0] == [(0, 64, 200)]
    long_then_short = [350] * 32 + [60] * 32  # 32 rows read 290 tokens fewer: far more than a call
    assert cuts(long_then_short, 330.0)[0] == [(0, 32, 350), (32, 64, 60)]
    assert cuts(long_then_short, 1e9)[0] == [(0, 64, 350)]  # a call dearer than the padding: one block
    assert cuts([0] * 8 + [100] * 8, 330.0)[0] == [(8, 16, 100)]  # slots not read this step: no block


def test_sorted_slots_are_never_sorted_and_a_decayed_order_is_once_the_padding_has_cost_the_copy():
    s = Sorter(call=330.0, copy=2.0)
    in_order = list(range(400, 336, -1))  # 64 rows, longest first
    assert all(s.due(in_order) is None for _ in range(100))
    decayed = in_order[:]
    decayed[0], decayed[-1] = decayed[-1], decayed[0]  # a short row where the longest was
    steps = 0
    while (order := s.due(decayed)) is None:
        steps += 1
        assert steps < 1000
    assert steps > 0 and s.spent == 0.0  # not at once: the copy must pay first
    assert [s for s, i in enumerate(order) if s != i] == [0, 63]  # the two rows out of their pieces swap
    assert [decayed[i] for i in order] == in_order


@given(st.lists(st.integers(1, 400), min_size=1, max_size=100))
def test_a_sort_puts_each_row_in_its_piece_by_rank_and_moves_no_row_already_there(lengths):
    order = pieces_by_rank(lengths)
    n, grain = len(lengths), grain_of(len(lengths))
    assert sorted(order) == list(range(n))
    ranked = sorted(lengths, reverse=True)
    for a in range(0, n, grain):
        assert sorted((lengths[i] for i in order[a : a + grain]), reverse=True) == ranked[a : a + grain]
    ranks = sorted(range(n), key=lambda i: (-lengths[i], i))  # ties: the earlier slot first
    home = {i: rank // grain for rank, i in enumerate(ranks)}
    assert all(order[i] == i for i in range(n) if home[i] == i // grain)  # in its piece: not moved
