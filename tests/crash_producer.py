"""A producer process for the crash tests: sends records "0", "1", "2", ... through the SDK until
STOP_FILE exists, riding out server crashes (reconnect, resend, dedup), then closes. It keeps
STATE_FILE saying "<sent> <acked>" (records handed to the producer, records acked).

Run: python tests/crash_producer.py TARGET STREAM STOP_FILE STATE_FILE
Exit 0 once every record is acked and the producer closed cleanly; 1 with the error otherwise.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

from sluice_client import Producer

PRODUCER_ID = "crash-test-producer"


def write_state(path: Path, sent: int, acked: int) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(f"{sent} {acked}\n")
    os.replace(tmp, path)


def stopped(stop_file: Path) -> bool:
    return stop_file.exists()  # a stat: too quick to be worth a thread


async def main(target: str, stream: str, stop_file: Path, state_file: Path) -> int:
    producer = Producer(
        target,
        stream,
        producer_id=PRODUCER_ID,
        batch_size=500,
        max_buffered=20_000,
        reconnect_timeout=180.0,
    )
    await producer.start()

    sent = 0

    async def report() -> None:
        while True:
            write_state(state_file, sent, producer.acked)
            await asyncio.sleep(0.05)

    reporter = asyncio.create_task(report())
    try:
        while not stopped(stop_file):
            await producer.send_many([str(i).encode() for i in range(sent, sent + 500)])
            sent += 500
        await producer.close(timeout=300)
    except Exception as exc:
        print(f"crash_producer: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        reporter.cancel()
        write_state(state_file, sent, producer.acked)
    print(f"crash_producer: all {sent} records acked", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main(sys.argv[1], sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4]))))
