"""The per-request delayed-codebook state machine (spec section 3), in slot-indexed tensors.

Owns, per slot: the last sampled row (the next step's audio input), `delay` (0..7),
`countdown` (-1 = not ending), `done`, and the number of rows sampled so far (the position of
the request's noise stream). State belongs to the request's slot, never to its batch row, so a
request keeps its state across steps, batch reshuffles and preemption.
"""

from __future__ import annotations

import torch

from engine.config import BOC, CODEBOOK_SIZE, EOC, NUM_CODEBOOKS

NOT_ENDING = -1


class DelayState:
    def __init__(self, max_slots: int, device: torch.device):
        self.last_codes = torch.zeros(max_slots, NUM_CODEBOOKS, dtype=torch.long, device=device)
        self.delay = torch.zeros(max_slots, dtype=torch.long, device=device)
        self.countdown = torch.full((max_slots,), NOT_ENDING, dtype=torch.long, device=device)
        self.done = torch.zeros(max_slots, dtype=torch.bool, device=device)
        self.num_rows = torch.zeros(max_slots, dtype=torch.long, device=device)

    def reset(self, slot: int) -> None:
        """Fresh state for a request that takes `slot` (its first row comes from the prefill)."""
        self.last_codes[slot] = 0
        self.delay[slot] = 0
        self.countdown[slot] = NOT_ENDING
        self.done[slot] = False
        self.num_rows[slot] = 0

    def reset_many(self, slots: torch.Tensor) -> None:
        """`reset` for every slot in the device tensor `slots` (five launches in all, no host
        values: admissions in a step cost the same whatever their number)."""
        for state, value in (
            (self.last_codes, 0),
            (self.delay, 0),
            (self.countdown, NOT_ENDING),
            (self.done, False),
            (self.num_rows, 0),
        ):
            state.index_fill_(0, slots, value)

    def masks(self, slots: torch.Tensor) -> torch.Tensor:
        """Boolean `[R, 8, 1026]`: True where a code is forbidden for the row of each slot."""
        return forbidden_codes(self.delay[slots], self.countdown[slots])

    def advance(self, slots: torch.Tensor, codes: torch.Tensor) -> None:
        """Applies the update rules after sampling `codes [R, 8]` for `slots [R]`."""
        delay, countdown = self.delay[slots], self.countdown[slots]
        new_delay, new_countdown, done = next_state(delay, countdown, codes)
        self.delay[slots] = new_delay
        self.countdown[slots] = new_countdown
        self.done[slots] = done
        self.last_codes[slots] = codes
        self.num_rows[slots] += 1


def forbidden_codes(delay: torch.Tensor, countdown: torch.Tensor) -> torch.Tensor:
    """Rule 2 of the spec as a mask over `[R, 8, 1026]` (True = may not be emitted)."""
    q = torch.arange(NUM_CODEBOOKS, device=delay.device)[None, :]  # [1, 8]
    code = torch.arange(CODEBOOK_SIZE, device=delay.device)[None, None, :]  # [1, 1, 1026]
    is_boc, is_eoc = code == BOC, code == EOC
    ending = (countdown >= 0)[:, None]  # [R, 1]

    # Not ending: codebooks q >= allowed may only emit BOC; q < allowed may not emit BOC,
    # and only codebook 0 may emit EOC.
    allowed = torch.clamp(delay + 1, max=NUM_CODEBOOKS)[:, None]
    started = (q < allowed)[:, :, None]
    running_forbid = torch.where(started, is_boc | (is_eoc & (q != 0)[:, :, None]), ~is_boc)

    # Ending with countdown r: codebooks q < 8 - r may only emit EOC; the others neither.
    finished = (q < NUM_CODEBOOKS - countdown[:, None])[:, :, None]
    ending_forbid = torch.where(finished, ~is_eoc, is_boc | is_eoc)
    return torch.where(ending[:, :, None], ending_forbid, running_forbid)


def next_state(
    delay: torch.Tensor, countdown: torch.Tensor, codes: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rule 3 of the spec: returns (delay, countdown, done) after a row `codes [R, 8]`."""
    ending = countdown >= 0
    new_delay = torch.where(~ending & (delay + 1 < NUM_CODEBOOKS), delay + 1, delay)
    new_countdown = torch.where(ending, countdown - 1, countdown)
    new_countdown = torch.where(~ending & (codes[:, 0] == EOC), 7, new_countdown)
    done = ending & (new_countdown == 0)
    return new_delay, new_countdown, done
