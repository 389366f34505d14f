"""Ending a helper task without taking its owner's cancellation."""

from __future__ import annotations

import asyncio
from typing import Any


async def reap(task: asyncio.Task[Any]) -> None:
    """Cancel `task` and wait for it to end, without swallowing a cancellation of the caller.

    `task.cancel(); with suppress(CancelledError): await task` also takes a cancel of the caller that
    arrives during the wait: the Producer's abort() then slept through a reconnect backoff and tried
    again for up to a minute, and `sluice push` could miss a SIGTERM. Here the task's own cancellation
    ends quietly and the caller's is raised again. The task's other exceptions propagate."""
    task.cancel()
    current = asyncio.current_task()
    before = current.cancelling() if current is not None else 0  # a caller already in its cleanup
    try:
        await task
    except asyncio.CancelledError:
        if current is not None and current.cancelling() > before:  # cancelled while it waited
            raise
