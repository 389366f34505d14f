"""reap(): a helper task ends, its owner's cancellation does not get lost."""

from __future__ import annotations

import asyncio

import pytest

from sluice_client.tasks import reap


async def _forever() -> None:
    await asyncio.Event().wait()


async def test_the_tasks_own_cancel_ends_quietly() -> None:
    task = asyncio.create_task(_forever())
    await asyncio.sleep(0)
    await reap(task)
    assert task.cancelled()


async def test_a_cancel_of_the_caller_during_the_wait_is_raised() -> None:
    """The case suppress(CancelledError) got wrong: the caller went on as if nothing had happened."""
    release = asyncio.Event()

    async def slow_to_end() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            await release.wait()  # cleanup that takes a while

    helper = asyncio.create_task(slow_to_end())
    await asyncio.sleep(0)
    went_on = False

    async def owner() -> None:
        nonlocal went_on
        await reap(helper)
        went_on = True

    task = asyncio.create_task(owner())
    await asyncio.sleep(0.01)
    task.cancel()  # while reap waits for the helper's cleanup
    await asyncio.sleep(0.01)
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not went_on
    assert helper.done()


async def test_a_caller_already_cancelled_is_not_raised_again() -> None:
    """Reaping inside cleanup that a cancel started (except CancelledError: ... reap(); raise) works."""
    helper = asyncio.create_task(_forever())
    reaped = False

    async def owner() -> None:
        nonlocal reaped
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            await reap(helper)
            reaped = True
            raise

    task = asyncio.create_task(owner())
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert reaped and helper.cancelled()


async def test_the_tasks_own_failure_propagates() -> None:
    async def fails() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            raise RuntimeError("cleanup failed")

    task = asyncio.create_task(fails())
    await asyncio.sleep(0)
    with pytest.raises(RuntimeError, match="cleanup failed"):
        await reap(task)
