"""Paged KV block accounting with content-hashed prefix reuse.

Owns which physical block holds which request's positions, reference counts, and the map from
a prompt block's content hash to the block that holds it. Block 0 is never handed out: padding
rows write their K/V there. Knows nothing of tensors; imports no torch.

Invariant: a block is in `_free` exactly when its reference count is 0. A free block keeps its
hash (and so stays reusable) until it is handed out again, oldest-freed first.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

NULL_BLOCK = 0


def hash_block(parent: bytes | None, keys: Sequence[object]) -> bytes:
    """Content hash of one full block, chained on its parent so equal hashes mean equal
    prefixes. `keys` are ints, or (int, tuple-of-ints) at placeholder positions."""
    h = hashlib.blake2b(parent or b"", digest_size=16)
    h.update(repr(tuple(keys)).encode())
    return h.digest()


def hash_prompt_blocks(
    keys: Sequence[object], block_size: int, parent: bytes | None = None
) -> list[bytes]:
    """Hashes of every full block of a prompt, in order (continuing a chain after `parent`
    when `keys` start at a block boundary inside a prompt)."""
    hashes: list[bytes] = []
    for start in range(0, len(keys) - block_size + 1, block_size):
        parent = hash_block(parent, keys[start : start + block_size])
        hashes.append(parent)
    return hashes


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 2:
            raise ValueError("need at least 2 KV blocks (block 0 is reserved)")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_count = [0] * num_blocks
        self._hash_of: list[bytes | None] = [None] * num_blocks
        self._block_of: dict[bytes, int] = {}
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    def blocks_needed(self, num_positions: int) -> int:
        return -(-num_positions // self.block_size)

    def match_prefix(self, hashes: Sequence[bytes]) -> list[int]:
        """Longest run of leading prompt blocks already in the cache."""
        if not self.enable_prefix_caching:
            return []
        blocks = []
        for h in hashes:
            block = self._block_of.get(h)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def can_take(self, cached: Sequence[int], num_new: int) -> bool:
        """Whether `cached` blocks can be shared and `num_new` fresh ones allocated at once."""
        reclaimed = sum(1 for b in cached if self._ref_count[b] == 0)
        return num_new + reclaimed <= len(self._free)

    def share(self, blocks: Sequence[int]) -> None:
        for b in blocks:
            if self._ref_count[b] == 0:
                del self._free[b]
            self._ref_count[b] += 1

    def allocate(self, num: int) -> list[int]:
        if num > len(self._free):
            raise RuntimeError(f"asked for {num} KV blocks with {len(self._free)} free")
        blocks = []
        for _ in range(num):
            b, _ = self._free.popitem(last=False)
            old = self._hash_of[b]
            if old is not None:  # evict: the block's content is about to change
                del self._block_of[old]
                self._hash_of[b] = None
            self._ref_count[b] = 1
            blocks.append(b)
        return blocks

    def free(self, blocks: Sequence[int]) -> None:
        # Release in reverse so a request's tail blocks are evicted before its prefix.
        for b in reversed(blocks):
            self._ref_count[b] -= 1
            if self._ref_count[b] < 0:
                raise RuntimeError(f"KV block {b} freed twice")
            if self._ref_count[b] == 0:
                self._free[b] = None

    def register(self, block: int, block_hash: bytes) -> None:
        """Marks a fully computed prompt block as reusable under its content hash."""
        if not self.enable_prefix_caching or self._hash_of[block] is not None:
            return
        if block_hash in self._block_of:  # computed twice concurrently: keep the first
            return
        self._hash_of[block] = block_hash
        self._block_of[block_hash] = block

    def num_cached_blocks(self) -> int:
        return len(self._block_of)
