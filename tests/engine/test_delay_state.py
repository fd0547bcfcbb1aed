"""The delayed-codebook state machine (spec section 3) against `engine.delay_state`.

Each rule is checked directly on `forbidden_codes` / `next_state`, then a plain-Python
re-implementation (loops, no tensors) drives simulated utterances through `DelayState` and the
two are compared row by row.
"""

from __future__ import annotations

import functools
import random

import pytest
import torch

from engine.config import (
    BOC,
    CODEBOOK_SIZE,
    EOC,
    FRAMES_PER_SECOND,
    MAX_ROWS,
    NUM_CODEBOOKS,
)
from engine.delay_state import NOT_ENDING, DelayState, forbidden_codes, next_state
from engine.prompt import undelay_rows

CPU = torch.device("cpu")
NUM_REAL = 1024


def t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long)


def allowed_set(mask_row: torch.Tensor) -> set[int]:
    """Codes one codebook may emit, from a forbidden mask row `[1026]`."""
    return set(torch.nonzero(~mask_row).flatten().tolist())


REAL = set(range(NUM_REAL))


# -- plain re-implementation of the rules (spec section 3) -------------------------------------


def plain_rules(delay: int, countdown: int) -> list[tuple[bool, bool, bool]]:
    """Per codebook: (real codes allowed, BOC allowed, EOC allowed)."""
    out = []
    for q in range(8):
        if countdown >= 0:
            if q < 8 - countdown:
                out.append((False, False, True))
            else:
                out.append((True, False, False))
        else:
            allowed = min(delay + 1, 8)
            if q >= allowed:
                out.append((False, True, False))
            else:
                out.append((True, False, q == 0))
    return out


def plain_update(delay: int, countdown: int, codes: list[int]) -> tuple[int, int, bool]:
    ending = countdown >= 0
    if not ending and delay + 1 < 8:
        delay += 1
    if ending:
        countdown -= 1
    elif codes[0] == EOC:
        countdown = 7
    done = ending and countdown == 0
    return delay, countdown, done


def plain_mask(rules: list[tuple[bool, bool, bool]]) -> torch.Tensor:
    """Forbidden mask `[8, 1026]` built from the plain rules, one entry at a time."""
    mask = torch.ones(NUM_CODEBOOKS, CODEBOOK_SIZE, dtype=torch.bool)
    for q, (real_ok, boc_ok, eoc_ok) in enumerate(rules):
        if real_ok:
            mask[q, :NUM_REAL] = False
        if boc_ok:
            mask[q, BOC] = False
        if eoc_ok:
            mask[q, EOC] = False
    return mask


@functools.cache
def cached_plain_mask(delay: int, countdown: int) -> torch.Tensor:
    return plain_mask(plain_rules(delay, countdown))


# -- rule 2: masks -------------------------------------------------------------------------------


def test_constants():
    assert (NUM_CODEBOOKS, CODEBOOK_SIZE, BOC, EOC, NOT_ENDING) == (8, 1026, 1024, 1025, -1)


@pytest.mark.parametrize("delay", range(8))
def test_mask_not_ending(delay):
    mask = forbidden_codes(t([delay]), t([NOT_ENDING]))
    assert mask.shape == (1, NUM_CODEBOOKS, CODEBOOK_SIZE)
    assert mask.dtype == torch.bool
    allowed = min(delay + 1, 8)
    for q in range(NUM_CODEBOOKS):
        codes = allowed_set(mask[0, q])
        if q >= allowed:
            assert codes == {BOC}, (delay, q)
        elif q == 0:
            assert codes == REAL | {EOC}, (delay, q)
        else:
            assert codes == REAL, (delay, q)
        if q < allowed:
            assert BOC not in codes


def test_mask_not_ending_counts_per_delay():
    """How many codebooks are started at each delay: 1, 2, ..., 8, 8 (7 saturates)."""
    mask = forbidden_codes(t(list(range(8))), t([NOT_ENDING] * 8))
    started = (~mask[:, :, :NUM_REAL]).all(-1).sum(-1)
    assert started.tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    boc_only = (~mask[:, :, BOC]) & mask[:, :, :NUM_REAL].all(-1) & mask[:, :, EOC]
    assert boc_only.sum(-1).tolist() == [7, 6, 5, 4, 3, 2, 1, 0]
    # EOC only ever allowed for codebook 0 while not ending.
    assert (~mask[:, 1:, EOC]).sum() == 0
    assert (~mask[:, 0, EOC]).all()


@pytest.mark.parametrize("r", range(7, 0, -1))
@pytest.mark.parametrize("delay", [0, 3, 7])
def test_mask_ending(r, delay):
    mask = forbidden_codes(t([delay]), t([r]))
    for q in range(NUM_CODEBOOKS):
        codes = allowed_set(mask[0, q])
        if q < 8 - r:
            assert codes == {EOC}, (r, q)
        else:
            assert codes == REAL, (r, q)
            assert BOC not in codes and EOC not in codes


def test_mask_countdown_zero_is_all_eoc():
    mask = forbidden_codes(t([7]), t([0]))
    for q in range(NUM_CODEBOOKS):
        assert allowed_set(mask[0, q]) == {EOC}


def test_mask_rows_are_independent():
    """A batch of mixed states gives each row the mask it would get alone."""
    delays = [0, 7, 2, 5, 7, 1, 4]
    countdowns = [-1, -1, 7, -1, 1, 3, -1]
    batched = forbidden_codes(t(delays), t(countdowns))
    for i, (d, c) in enumerate(zip(delays, countdowns, strict=True)):
        assert torch.equal(batched[i], forbidden_codes(t([d]), t([c]))[0])
        assert torch.equal(batched[i], plain_mask(plain_rules(d, c)))


def test_mask_matches_plain_rules_everywhere():
    for d in range(8):
        for c in [NOT_ENDING, *range(8)]:
            assert torch.equal(forbidden_codes(t([d]), t([c]))[0], plain_mask(plain_rules(d, c)))


# -- rule 3: update --------------------------------------------------------------------------


def real_row(value: int = 5) -> list[int]:
    return [value] * NUM_CODEBOOKS


@pytest.mark.parametrize("delay", range(8))
def test_update_delay_increments_and_saturates(delay):
    d, c, done = next_state(t([delay]), t([NOT_ENDING]), t([real_row()]))
    assert d.tolist() == [min(delay + 1, 7)]
    assert c.tolist() == [NOT_ENDING]
    assert done.tolist() == [False]


def test_update_delay_stops_at_seven_over_many_rows():
    d, c = t([0]), t([NOT_ENDING])
    seen = []
    for _ in range(20):
        d, c, done = next_state(d, c, t([real_row()]))
        seen.append(d.item())
        assert not done.item()
    assert seen == [1, 2, 3, 4, 5, 6, 7] + [7] * 13


@pytest.mark.parametrize("delay", [0, 3, 6, 7])
def test_update_eoc_on_codebook0_starts_countdown(delay):
    row = [EOC] + [BOC] * 7 if delay == 0 else [EOC] + [7] * 7
    d, c, done = next_state(t([delay]), t([NOT_ENDING]), t([row]))
    assert c.tolist() == [7]
    assert d.tolist() == [min(delay + 1, 7)]  # delay still advances on the EOC row itself
    assert done.tolist() == [False]


def test_update_eoc_on_other_codebook_does_not_end():
    row = real_row()
    row[3] = EOC
    _, c, done = next_state(t([7]), t([NOT_ENDING]), t([row]))
    assert c.tolist() == [NOT_ENDING] and done.tolist() == [False]


@pytest.mark.parametrize("r", range(7, 0, -1))
def test_update_countdown_decrements_and_finishes(r):
    row = [EOC] * (8 - r) + [9] * r
    d, c, done = next_state(t([4]), t([r]), t([row]))
    assert c.tolist() == [r - 1]
    assert d.tolist() == [4]  # delay frozen while ending
    assert done.tolist() == [r - 1 == 0]


def test_update_eoc_while_ending_does_not_restart_countdown():
    _, c, _ = next_state(t([7]), t([3]), t([[EOC] * 5 + [1, 2, 3]]))
    assert c.tolist() == [2]


def test_update_batch_rows_independent():
    delays = t([0, 7, 5, 2, 7])
    countdowns = t([-1, -1, 1, 4, -1])
    codes = t([real_row(), [EOC] + [3] * 7, [EOC] * 7 + [1], [EOC] * 4 + [2] * 4, real_row()])
    d, c, done = next_state(delays, countdowns, codes)
    expected = [
        plain_update(dd, cc, row)
        for dd, cc, row in zip(delays.tolist(), countdowns.tolist(), codes.tolist(), strict=True)
    ]
    assert d.tolist() == [e[0] for e in expected] == [1, 7, 5, 2, 7]
    assert c.tolist() == [e[1] for e in expected] == [-1, 7, 0, 3, -1]
    assert done.tolist() == [e[2] for e in expected] == [False, False, True, False, False]


# -- the DelayState class ----------------------------------------------------------------------


def test_initial_and_reset_state():
    state = DelayState(3, CPU)
    assert state.delay.tolist() == [0, 0, 0]
    assert state.countdown.tolist() == [NOT_ENDING] * 3
    assert state.done.tolist() == [False] * 3
    assert state.num_rows.tolist() == [0, 0, 0]
    assert state.last_codes.shape == (3, NUM_CODEBOOKS)

    slots = t([1])
    for _ in range(9):
        state.advance(slots, t([real_row(3)]))
    state.advance(slots, t([[EOC] + [3] * 7]))
    state.advance(slots, t([[EOC] + [3] * 7]))
    assert (state.delay[1].item(), state.countdown[1].item(), state.num_rows[1].item()) == (
        7,
        6,
        11,
    )
    state.reset(1)
    assert state.delay[1].item() == 0
    assert state.countdown[1].item() == NOT_ENDING
    assert not state.done[1].item()
    assert state.num_rows[1].item() == 0
    assert state.last_codes[1].tolist() == [0] * 8
    assert torch.equal(state.masks(slots)[0], plain_mask(plain_rules(0, NOT_ENDING)))


def test_masks_follow_slot_order():
    state = DelayState(4, CPU)
    state.delay[:] = t([0, 2, 5, 7])
    state.countdown[:] = t([-1, -1, 3, -1])
    masks = state.masks(t([2, 0, 3]))
    assert masks.shape == (3, NUM_CODEBOOKS, CODEBOOK_SIZE)
    assert torch.equal(masks[0], plain_mask(plain_rules(5, 3)))
    assert torch.equal(masks[1], plain_mask(plain_rules(0, -1)))
    assert torch.equal(masks[2], plain_mask(plain_rules(7, -1)))


def test_advance_is_slot_indexed():
    state = DelayState(4, CPU)
    state.delay[:] = t([2, 4, 6, 1])
    state.countdown[:] = t([-1, -1, 5, -1])
    state.num_rows[:] = t([10, 20, 30, 40])
    state.last_codes[:] = torch.arange(32).view(4, 8)
    before = {
        name: getattr(state, name).clone()
        for name in ("delay", "countdown", "done", "num_rows", "last_codes")
    }

    row_for_3 = [EOC] + [11] * 7  # slot 3 (delay 1) starts ending
    row_for_1 = [12] * 8
    state.advance(t([3, 1]), t([row_for_3, row_for_1]))

    for slot in (0, 2):
        for name, value in before.items():
            assert torch.equal(getattr(state, name)[slot], value[slot]), (slot, name)
    assert state.last_codes[3].tolist() == row_for_3
    assert state.last_codes[1].tolist() == row_for_1
    assert (state.delay[3].item(), state.countdown[3].item()) == (2, 7)
    assert (state.delay[1].item(), state.countdown[1].item()) == (5, NOT_ENDING)
    assert state.num_rows.tolist() == [10, 21, 30, 41]
    assert state.done.tolist() == [False] * 4


def test_done_set_on_last_row_only():
    state = DelayState(2, CPU)
    slots = t([0])
    state.countdown[0] = 2
    state.advance(slots, t([[EOC] * 6 + [1, 1]]))
    assert not state.done[0].item()
    state.advance(slots, t([[EOC] * 7 + [1]]))
    assert state.done[0].item()
    assert state.countdown[0].item() == 0


# -- simulated utterances ---------------------------------------------------------------------


def simulate(
    eoc_row: int | None, num_rows_cap: int, slot: int = 2, seed: int = 0, mask_every: int = 1
):
    """Drives one request through DelayState and the plain rules side by side.

    At each row every codebook emits an allowed code: a pseudo-random real code where real
    codes are allowed, else the one pad that is allowed. Codebook 0 emits EOC at `eoc_row`.
    The vectorized mask is compared with the plain one on every row (or, for long runs, on
    the first 16 rows and every `mask_every`-th after). Returns the rows and the row index
    after which `done` was set (or None).
    """
    rng = random.Random(seed)
    state = DelayState(4, CPU)
    state.reset(slot)
    slots = t([slot])
    delay, countdown = 0, NOT_ENDING
    rows: list[tuple[int, ...]] = []
    for row_index in range(num_rows_cap):
        rules = plain_rules(delay, countdown)
        if row_index < 16 or row_index % mask_every == 0:
            vec_mask = state.masks(slots)[0]
            assert torch.equal(vec_mask, cached_plain_mask(delay, countdown)), row_index
        else:
            vec_mask = cached_plain_mask(delay, countdown)
        codes = []
        for q, (real_ok, boc_ok, eoc_ok) in enumerate(rules):
            if q == 0 and row_index == eoc_row:
                assert eoc_ok and countdown == NOT_ENDING
                codes.append(EOC)
            elif real_ok:
                codes.append(rng.randrange(NUM_REAL))
            elif boc_ok:
                codes.append(BOC)
            else:
                assert eoc_ok
                codes.append(EOC)
        assert not vec_mask[torch.arange(NUM_CODEBOOKS), t(codes)].any()
        state.advance(slots, t([codes]))
        delay, countdown, done = plain_update(delay, countdown, codes)
        rows.append(tuple(codes))
        assert state.delay[slot].item() == delay
        assert state.countdown[slot].item() == countdown
        assert state.done[slot].item() == done
        assert state.num_rows[slot].item() == row_index + 1
        assert state.last_codes[slot].tolist() == codes
        if done:
            return rows, row_index
    return rows, None


@pytest.mark.parametrize("s", [0, 1, 3, 7, 8, 20])
def test_simulated_utterance_ends_after_s_plus_8_rows(s):
    rows, done_at = simulate(eoc_row=s, num_rows_cap=s + 40, seed=s)
    assert len(rows) == s + 8
    assert done_at == s + 7

    # Before the EOC row the delay ramp: codebook q is BOC in rows 0..q-1.
    for r in range(min(s + 1, 8)):
        for q in range(NUM_CODEBOOKS):
            if q > r:
                assert rows[r][q] == BOC, (r, q)
            elif not (r == s and q == 0):
                assert 0 <= rows[r][q] < NUM_REAL, (r, q)
    # The ramp down: row s + k (k = 1..7) has EOC in codebooks 0..k-1, real codes after.
    for k in range(1, 8):
        row = rows[s + k]
        assert row[:k] == (EOC,) * k
        assert all(0 <= c < NUM_REAL for c in row[k:]), (k, row)

    frames = undelay_rows(rows)
    assert len(frames) == s + 1
    assert frames[s][0] == EOC
    assert all(0 <= c < NUM_REAL for c in frames[s][1:])
    for f in range(s):
        assert all(0 <= c < NUM_REAL for c in frames[f]), f
    # The utterance proper is s frames = s * 40 ms.
    assert len(frames[:-1]) / FRAMES_PER_SECOND == pytest.approx(s * 0.040)


def test_length_cap_arithmetic():
    assert MAX_ROWS == 2048
    assert FRAMES_PER_SECOND == 25
    rows, done_at = simulate(eoc_row=None, num_rows_cap=MAX_ROWS, seed=99, mask_every=64)
    assert done_at is None
    assert len(rows) == 2048
    frames = undelay_rows(rows)
    assert len(frames) == 2041
    assert all(0 <= c < NUM_REAL for frame in frames for c in frame)
    kept = frames[:-1]
    assert len(kept) == 2040
    assert len(kept) / FRAMES_PER_SECOND == pytest.approx(81.6)


def test_reset_many_equals_reset_per_slot():
    """The runner resets the slots admitted in a step at once (`reset_many`, from a device
    tensor of slots): the same state as `reset` slot by slot, other slots untouched."""
    one, many = DelayState(6, CPU), DelayState(6, CPU)
    slots = t([0, 1, 2, 3, 4, 5])
    for state in (one, many):  # every slot somewhere mid-utterance, ending in some
        for _ in range(9):
            state.advance(slots, t([real_row(s) for s in range(6)]))
        state.advance(t([1, 4]), t([[EOC] + [3] * 7, [EOC] + [5] * 7]))
    for slot in (4, 1, 3):
        one.reset(slot)
    many.reset_many(t([4, 1, 3]))
    for name in ("last_codes", "delay", "countdown", "done", "num_rows"):
        assert torch.equal(getattr(one, name), getattr(many, name)), name
    assert many.num_rows[0].item() == 9 and many.num_rows[3].item() == 0
