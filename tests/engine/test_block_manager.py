"""CPU tests of the paged KV block accounting and the prefix-cache hashing (no torch)."""

from __future__ import annotations

import pytest

from engine.block_manager import NULL_BLOCK, BlockManager, hash_block, hash_prompt_blocks

ROW_A = (1, 2, 3, 4, 5, 6, 7, 8)
ROW_B = (1, 2, 3, 4, 5, 6, 7, 9)


def _hashes(n: int) -> list[bytes]:
    """`n` distinct chained block hashes."""
    return hash_prompt_blocks(list(range(n * 4)), 4)


# -- hashing ---------------------------------------------------------------------------------


def test_equal_prefixes_give_equal_hashes():
    a = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]
    b = [1, 2, 3, 4, 5, 6, 7, 8, 99, 98, 97, 96]
    ha, hb = hash_prompt_blocks(a, 4), hash_prompt_blocks(b, 4)
    assert len(ha) == len(hb) == 3
    assert ha[:2] == hb[:2]
    assert ha[2] != hb[2]
    # Deterministic across calls and equal to the explicit chain.
    assert hash_prompt_blocks(list(a), 4) == ha
    h0 = hash_block(None, a[0:4])
    assert ha == [h0, hash_block(h0, a[4:8]), hash_block(hash_block(h0, a[4:8]), a[8:12])]


def test_different_earlier_block_changes_every_later_hash():
    a = list(range(16))
    b = [100, *range(1, 16)]  # only position 0 differs
    ha, hb = hash_prompt_blocks(a, 4), hash_prompt_blocks(b, 4)
    assert len(ha) == len(hb) == 4
    for x, y in zip(ha, hb, strict=True):
        assert x != y
    # The later blocks' own contents are identical: only the chaining tells them apart.
    assert a[4:] == b[4:]


def test_same_block_content_under_different_parents_differs():
    keys = [5, 6, 7, 8]
    assert hash_block(None, keys) != hash_block(hash_block(None, [1, 2, 3, 4]), keys)
    assert hash_block(None, keys) == hash_block(None, tuple(keys))


def test_placeholder_rows_are_part_of_the_hash():
    base = [1, 2, (9, ROW_A), 4]
    other_row = [1, 2, (9, ROW_B), 4]
    no_row = [1, 2, 9, 4]
    assert hash_block(None, base) == hash_block(None, [1, 2, (9, ROW_A), 4])
    assert hash_block(None, base) != hash_block(None, other_row)
    assert hash_block(None, base) != hash_block(None, no_row)
    # And the difference propagates to later blocks through the chain.
    tail = [10, 11, 12, 13]
    assert hash_prompt_blocks(base + tail, 4)[1] != hash_prompt_blocks(other_row + tail, 4)[1]


def test_only_full_blocks_are_hashed():
    keys = list(range(12))
    hashes = hash_prompt_blocks(keys[:11], 4)
    assert len(hashes) == 2
    assert hashes == hash_prompt_blocks(keys[:8], 4)
    assert len(hash_prompt_blocks(keys[:12], 4)) == 3
    assert hash_prompt_blocks(keys[:3], 4) == []
    assert hash_prompt_blocks([], 4) == []
    assert len(hash_prompt_blocks(keys[:4], 4)) == 1


# -- allocation and reference counts ---------------------------------------------------------


def test_needs_two_blocks():
    with pytest.raises(ValueError):
        BlockManager(1, 4)
    bm = BlockManager(2, 4)
    assert bm.num_usable_blocks == 1
    assert bm.allocate(1) == [1]


def test_blocks_needed():
    bm = BlockManager(8, 4)
    assert [bm.blocks_needed(n) for n in (0, 1, 3, 4, 5, 8, 9)] == [0, 1, 1, 1, 2, 2, 3]


def test_null_block_is_never_allocated():
    bm = BlockManager(6, 4)
    assert bm.num_usable_blocks == 5
    assert bm.num_free_blocks == 5
    got = bm.allocate(5)
    assert NULL_BLOCK not in got
    assert sorted(got) == [1, 2, 3, 4, 5]
    assert bm.num_free_blocks == 0
    with pytest.raises(RuntimeError):
        bm.allocate(1)
    # Round trips through the free pool never produce block 0 either.
    bm.free(got)
    for _ in range(10):
        again = bm.allocate(5)
        assert NULL_BLOCK not in again
        assert len(set(again)) == 5
        bm.free(again)
    assert bm.num_free_blocks == 5


def test_allocate_too_many_raises_and_changes_nothing():
    bm = BlockManager(4, 4)
    a = bm.allocate(2)
    with pytest.raises(RuntimeError):
        bm.allocate(2)
    assert bm.num_free_blocks == 1
    assert bm.allocate(0) == []
    b = bm.allocate(1)
    assert set(a).isdisjoint(b)


def test_allocate_free_and_reference_counts():
    bm = BlockManager(5, 4)
    blocks = bm.allocate(2)
    assert bm.num_free_blocks == 2
    bm.share(blocks[:1])  # a second owner of the first block
    bm.free(blocks)  # first owner lets go of both
    assert bm.num_free_blocks == 3  # the shared block is still held
    fresh = bm.allocate(3)
    assert blocks[0] not in fresh
    assert blocks[1] in fresh
    bm.free(blocks[:1])  # last owner lets go
    assert bm.num_free_blocks == 1
    assert bm.allocate(1) == blocks[:1]


def test_freeing_twice_raises():
    bm = BlockManager(4, 4)
    blocks = bm.allocate(1)
    bm.free(blocks)
    with pytest.raises(RuntimeError):
        bm.free(blocks)


def test_freeing_shared_block_once_per_owner_then_raises():
    bm = BlockManager(4, 4)
    blocks = bm.allocate(1)
    bm.share(blocks)
    bm.free(blocks)
    bm.free(blocks)
    assert bm.num_free_blocks == 3
    with pytest.raises(RuntimeError):
        bm.free(blocks)


def test_freeing_null_block_raises():
    bm = BlockManager(4, 4)
    with pytest.raises(RuntimeError):
        bm.free([NULL_BLOCK])


# -- prefix cache ----------------------------------------------------------------------------


def test_register_and_match_longest_leading_run():
    bm = BlockManager(8, 4)
    h = _hashes(4)
    blocks = bm.allocate(3)
    for b, bh in zip(blocks, h[:3], strict=True):
        bm.register(b, bh)
    assert bm.num_cached_blocks() == 3
    assert bm.match_prefix(h[:3]) == blocks
    assert bm.match_prefix(h) == blocks  # h[3] was never registered
    assert bm.match_prefix(h[:2]) == blocks[:2]
    assert bm.match_prefix([]) == []
    missing = _hashes(1)[0] + b"x"
    # Stops at the first miss even when later hashes are cached.
    assert bm.match_prefix([h[0], missing, h[2]]) == blocks[:1]
    assert bm.match_prefix([missing, h[1], h[2]]) == []


def test_cached_blocks_survive_free_and_share_removes_them_from_free_pool():
    bm = BlockManager(6, 4)
    h = _hashes(2)
    blocks = bm.allocate(2)
    bm.register(blocks[0], h[0])
    bm.register(blocks[1], h[1])
    bm.free(blocks)
    assert bm.num_free_blocks == 5
    assert bm.match_prefix(h) == blocks  # still reusable while free
    bm.share(blocks[:1])
    assert bm.num_free_blocks == 4
    # The shared block is never handed out by allocate while it is held.
    rest = bm.allocate(4)
    assert blocks[0] not in rest
    assert bm.num_free_blocks == 0
    assert bm.match_prefix(h[:1]) == blocks[:1]
    # blocks[1] was free and got reallocated: its hash is gone.
    assert blocks[1] in rest
    assert bm.match_prefix(h) == blocks[:1]
    bm.free(blocks[:1])
    assert bm.num_free_blocks == 1


def test_allocating_a_cached_free_block_evicts_its_hash_tail_first():
    bm = BlockManager(3, 4)  # two usable blocks
    h = _hashes(2)
    blocks = bm.allocate(2)
    bm.register(blocks[0], h[0])
    bm.register(blocks[1], h[1])
    bm.free(blocks)
    assert bm.num_cached_blocks() == 2
    assert bm.match_prefix(h) == blocks
    first = bm.allocate(1)
    # The tail block is released first, so it is the first evicted; the prefix survives.
    assert first == blocks[1:]
    assert bm.num_cached_blocks() == 1
    assert bm.match_prefix(h) == blocks[:1]
    assert bm.match_prefix(h[1:]) == []
    second = bm.allocate(1)
    assert second == blocks[:1]
    assert bm.num_cached_blocks() == 0
    assert bm.match_prefix(h) == []
    # A re-registered evicted hash points at the new holder.
    bm.register(second[0], h[1])
    assert bm.match_prefix(h[1:]) == second


def test_free_order_oldest_freed_is_allocated_first():
    bm = BlockManager(5, 4)
    a = bm.allocate(1)
    b = bm.allocate(1)
    c = bm.allocate(1)
    bm.free(b)
    bm.free(a)
    bm.free(c)
    # One block (4) was never handed out and is oldest in the pool.
    assert bm.allocate(4) == [4, *b, *a, *c]


def test_can_take_accounts_for_reclaimed_cached_free_blocks():
    bm = BlockManager(5, 4)  # four usable
    h = _hashes(2)
    cached = bm.allocate(2)
    bm.register(cached[0], h[0])
    bm.register(cached[1], h[1])
    bm.free(cached)
    assert bm.num_free_blocks == 4
    # Both cached blocks are free, so taking them uses up 2 of the 4 free blocks.
    assert bm.can_take(cached, 2)
    assert not bm.can_take(cached, 3)
    assert bm.can_take([], 4)
    # When one cached block is already held elsewhere, only the other one is reclaimed.
    bm.share(cached[:1])
    assert bm.num_free_blocks == 3
    assert bm.can_take(cached, 2)
    assert not bm.can_take(cached, 3)
    # can_take's answer is honoured: share + allocate succeeds and leaves the pool empty.
    bm.share(cached)
    new = bm.allocate(2)
    assert set(new).isdisjoint(cached)
    assert bm.num_free_blocks == 0
    assert bm.match_prefix(h) == cached


def test_prefix_caching_disabled_never_matches():
    bm = BlockManager(6, 4, enable_prefix_caching=False)
    h = _hashes(2)
    blocks = bm.allocate(2)
    bm.register(blocks[0], h[0])
    bm.register(blocks[1], h[1])
    assert bm.num_cached_blocks() == 0
    assert bm.match_prefix(h) == []
    bm.free(blocks)
    assert bm.match_prefix(h) == []
    assert bm.num_free_blocks == 5


def test_register_same_hash_twice_keeps_first_block():
    bm = BlockManager(6, 4)
    h = _hashes(1)
    first, second = bm.allocate(2)
    bm.register(first, h[0])
    bm.register(second, h[0])
    assert bm.num_cached_blocks() == 1
    assert bm.match_prefix(h) == [first]
    # The second block never carried the hash, so recycling it must not evict the first's.
    bm.free([second])
    recycled = bm.allocate(4)
    assert second in recycled
    assert bm.match_prefix(h) == [first]


def test_register_on_already_hashed_block_is_ignored():
    bm = BlockManager(4, 4)
    h = _hashes(2)
    (block,) = bm.allocate(1)
    bm.register(block, h[0])
    bm.register(block, h[1])
    assert bm.match_prefix(h[:1]) == [block]
    assert bm.match_prefix(h[1:]) == []
    assert bm.num_cached_blocks() == 1
