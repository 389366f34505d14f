"""`sluice push` on a terminal (a real pty) against a slow server: the progress bar counts acked
records and is redrawn several times a second from the start, also while the push waits for credit
and acks; on a pipe the plain progress line stays as it was."""

from __future__ import annotations

import asyncio
import fcntl
import itertools
import os
import pty
import re
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

from support import running_server

SLUICE = str(Path(sys.executable).parent / "sluice")
ANSI = re.compile(rb"\x1b\[[0-9;?]*[A-Za-z]")
RECORDS = 9_000
RATE = 3_000.0  # records/s: a push of about 3 s, mostly waiting for credit


def read_all(fd: int) -> list[tuple[float, bytes]]:
    """What the terminal showed, chunk by chunk with when it came, until the process closed it."""
    chunks = []
    while True:
        try:
            data = os.read(fd, 65536)
        except OSError:  # EIO: the child closed its end
            return chunks
        if not data:
            return chunks
        chunks.append((time.monotonic(), data))


async def test_push_progress_on_a_terminal_redraws_while_waiting_for_acks(tmp_path: Path) -> None:
    source = tmp_path / "input.txt"
    source.write_text("".join(f"record {i}\n" for i in range(RECORDS)))
    env = {**os.environ, "TERM": "xterm-256color", "COLUMNS": "120"}
    async with running_server(tmp_path / "data", "default", prefetch=300, low_tide=100) as server:
        server.rate.update(RATE)
        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
        started = time.monotonic()
        proc = await asyncio.create_subprocess_exec(
            SLUICE,
            "push",
            str(source),
            "--target",
            server.target,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=slave,
            env=env,
        )
        os.close(slave)
        try:
            chunks = await asyncio.wait_for(asyncio.to_thread(read_all, master), 120)
            code = await asyncio.wait_for(proc.wait(), 30)
        finally:
            os.close(master)
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        took = time.monotonic() - started
    text = b"".join(data for _, data in chunks)
    assert code == 0, text.decode(errors="replace")
    plain = ANSI.sub(b"", text).decode(errors="replace")
    assert f"pushed {RECORDS:,} records" in plain
    assert f"{RECORDS:,} acked of {RECORDS:,}" in plain
    assert took > 0.6 * RECORDS / RATE  # the server was slow indeed
    # each frame with its acked count, in order
    frames = [
        (at, int(m.group(1).replace(b",", b"")))
        for at, data in chunks
        for m in re.finditer(rb"([\d,]+) acked(?!/s)", ANSI.sub(b"", data))
    ]
    counts = [count for _, count in frames]
    assert counts == sorted(counts), counts  # acked only grows
    assert len(set(counts)) >= 5, counts  # seen growing while acks came in, not only at the end
    assert counts[0] < RECORDS / 3, counts  # drawn early, long before everything was acked
    times = [at for at, _ in frames]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert max(gaps) < 1.0, gaps  # redrawn every 0.25 s while waiting (a generous bound)
    assert len(frames) >= (times[-1] - times[0]) / 0.5, (len(frames), times[-1] - times[0])


async def test_push_progress_on_a_pipe_is_the_plain_line(tmp_path: Path) -> None:
    source = tmp_path / "input.txt"
    source.write_text("".join(f"record {i}\n" for i in range(1_000)))
    async with running_server(tmp_path / "data", "default") as server:
        result = await asyncio.to_thread(
            subprocess.run,
            [SLUICE, "push", str(source), "--target", server.target],
            capture_output=True,
            timeout=60,
            check=False,
        )
    assert result.returncode == 0, result.stderr
    assert b"\x1b[" not in result.stderr  # no terminal codes into a log
    assert b"1,000 records, 1,000 acked" in result.stderr
    assert b"pushed 1,000 records" in result.stderr


async def test_push_progress_under_json_logs_is_json_lines_on_a_pipe_and_a_terminal(tmp_path: Path) -> None:
    """`sluice --log-format json push` wrote its progress as the plain "\\r[###...]" line (and its last
    line as "sluice: pushed ...") among the JSON log lines: a log shipper got two formats on one
    stream. Every line of its stderr is a JSON object now, progress as event "push-progress" with the
    figures as fields, about once a second while it waits for acks; on a terminal too (no bar)."""
    import json

    source = tmp_path / "input.txt"
    source.write_text("".join(f"record {i}\n" for i in range(RECORDS)))
    async with running_server(tmp_path / "data", "default", prefetch=300, low_tide=100) as server:
        server.rate.update(RATE)  # about 3 s of waiting for credit: several progress lines
        command = [SLUICE, "--log-format", "json", "push", str(source), "--target", server.target]
        result = await asyncio.to_thread(
            subprocess.run, command, capture_output=True, timeout=120, check=False
        )
        assert result.returncode == 0, result.stderr
        lines = result.stderr.decode().splitlines()
        entries = [json.loads(line) for line in lines]  # every line is JSON: no "\r", no "sluice: "
        progress = [e for e in entries if e.get("event") == "push-progress"]
        assert len(progress) >= 2, lines
        acked = [e["acked"] for e in progress]
        assert acked == sorted(acked) and acked[0] < RECORDS, acked  # shown while it went on
        assert progress[-1]["final"] is True and progress[-1]["acked"] == RECORDS
        assert progress[-1]["records"] == RECORDS and progress[-1]["total_bytes"] == source.stat().st_size
        assert [e["message"] for e in entries if e.get("event") == "pushed"] == [
            f"pushed {RECORDS:,} records to stream 'default'; all acked"
        ]
        # on a terminal as well: JSON lines, not a bar among them
        master, slave = pty.openpty()
        proc = await asyncio.create_subprocess_exec(
            *command,
            "--producer-id",
            "tty",
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=slave,
        )
        os.close(slave)
        try:
            chunks = await asyncio.wait_for(asyncio.to_thread(read_all, master), 120)
            code = await asyncio.wait_for(proc.wait(), 30)
        finally:
            os.close(master)
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    text = b"".join(data for _, data in chunks).decode()
    assert code == 0, text
    shown = [json.loads(line) for line in text.splitlines() if line.strip()]
    assert any(e.get("event") == "push-progress" and e["final"] for e in shown), text
    assert "\x1b[" not in text
