"""The worker's serial thread (actors/worker/serial.py): its jobs run one at a time in
the order submitted, off the event loop, each straight after the one before."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from actorlm.actors.worker.serial import SerialThread


def test_results_and_errors_come_back_in_order_from_one_thread() -> None:
    async def main() -> None:
        serial = SerialThread("test-steps")
        ran: list[tuple[int, str]] = []

        def job(i: int) -> int:
            time.sleep(0.002 * (5 - i))  # the earlier, the slower: order is not by luck
            ran.append((i, threading.current_thread().name))
            return i * i

        def fails() -> None:
            raise ValueError("a bad page")

        futures = [serial.submit(lambda i=i: job(i)) for i in range(5)]
        failed = serial.submit(fails)
        assert await asyncio.gather(*futures) == [0, 1, 4, 9, 16]
        with pytest.raises(ValueError, match="a bad page"):
            await failed
        assert [i for i, _ in ran] == list(range(5))
        assert {name for _, name in ran} == {"test-steps"}
        assert await serial.submit(lambda: "still serving") == "still serving"
        serial.close()
        serial._thread.join(timeout=5)
        assert not serial._thread.is_alive()

    asyncio.run(main())


def test_a_queued_job_starts_without_the_event_loop() -> None:
    """The second step starts as the first ends, while the loop is still busy elsewhere:
    no round through the loop between two steps."""

    async def main() -> None:
        serial = SerialThread("test-steps")
        second_ran = threading.Event()
        first = serial.submit(lambda: time.sleep(0.05))
        second = serial.submit(second_ran.set)
        # The loop is blocked here (no await), so nothing of it can start the second job.
        assert second_ran.wait(timeout=5)
        assert not first.done()  # its result reaches the loop only once it runs again
        await asyncio.gather(first, second)
        serial.close()

    asyncio.run(main())


def test_a_waiter_cancelled_leaves_the_thread_serving() -> None:
    async def main() -> None:
        serial = SerialThread("test-steps")
        slow = serial.submit(lambda: time.sleep(0.05))
        slow.cancel()  # its caller went away (an actor stopping): the job still runs
        assert await serial.submit(lambda: 42) == 42
        serial.close()

    asyncio.run(main())
