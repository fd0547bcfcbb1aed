"""Host-side state of one request: its prompt, generated rows, KV blocks and lifecycle.

The GPU-side sampling state lives in the runner's slot-indexed tensors; this object only
records which slot it owns. Imports no torch.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from engine.config import SamplingParams
from engine.prompt import AudioRow, Prompt


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    EOS = "eos"  # codebook 0 emitted EOC and the 7-row ramp completed
    LENGTH = "length"  # max_rows reached
    ABORT = "abort"  # aborted by the caller
    ERROR = "error"  # its audio could not be decoded (other requests are unaffected)


# slots: the scheduler, runner and engine read these fields for every request every step
@dataclass(eq=False, slots=True)
class Request:
    request_id: str
    prompt: Prompt
    params: SamplingParams
    seed: int
    arrival_time: float = field(default_factory=time.monotonic)
    output_rows: list[AudioRow] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    num_computed: int = 0  # positions whose K/V are in the cache
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # full prompt blocks
    slot: int | None = None
    num_cached_tokens: int = 0  # prompt positions taken from the prefix cache
    num_preemptions: int = 0
    first_scheduled_time: float | None = None  # its first step (queue time ends)
    first_row_time: float | None = None
    num_inflight: int = 0  # rows sampled by a launched step and not read back yet (0 or 1)
    prompt_len: int = field(init=False)  # len(prompt), read every step

    def __post_init__(self) -> None:
        self.prompt_len = len(self.prompt)

    @property
    def num_rows(self) -> int:
        """Rows sampled so far, the one still in flight included."""
        return len(self.output_rows) + self.num_inflight

    @property
    def num_positions(self) -> int:
        """Every input position: the prompt, then each generated row fed back as input."""
        return self.prompt_len + len(self.output_rows) + self.num_inflight

    @property
    def num_pending(self) -> int:
        return self.num_positions - self.num_computed

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
