"""Field types of the control messages: bounded strings, ranks and sizes, and texts
that are shortened in the middle rather than refused when they grow too long."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

Str = Annotated[str, Field(max_length=256)]
Hex = Annotated[str, Field(min_length=16, max_length=128, pattern="^[0-9a-f]+$")]
Rank = Annotated[int, Field(ge=0, lt=1 << 20)]
Size = Annotated[int, Field(ge=1, lt=1 << 20)]


def clip_text(limit: int) -> Callable[[object], object]:
    """Shorten a text longer than ``limit`` characters in the middle (a marker says how
    much), instead of refusing it: a reason that grows with the job (a verdict naming
    many ranks) must never make its message impossible to send."""

    def clip(value: object) -> object:
        if not isinstance(value, str) or len(value) <= limit:
            return value
        cut = len(value) - limit
        while True:
            marker = f" [... {cut} characters cut ...] "
            keep = limit - len(marker)
            if len(value) - keep == cut:
                break
            cut = len(value) - keep
        head = keep * 3 // 4
        return value[:head] + marker + value[len(value) - (keep - head) :]

    return clip


Text = Annotated[str, BeforeValidator(clip_text(8192)), Field(max_length=8192)]
Reason = Annotated[str, BeforeValidator(clip_text(4096)), Field(max_length=4096)]
Cause = Annotated[str, BeforeValidator(clip_text(1024)), Field(max_length=1024)]  # in a list
# Tracebacks are clipped to this many characters (from the end) so that a Failure or an
# Abort, with its reason and diagnosis, stays inside the 64 KiB control-frame limit.
TRACEBACK_CHARS = 24 * 1024
Trace = Annotated[str, Field(max_length=TRACEBACK_CHARS)]


class Msg(BaseModel):
    """Base of every control message: immutable, unknown fields ignored (older peers)."""

    model_config = ConfigDict(frozen=True, extra="ignore")
