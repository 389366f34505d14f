"""Every code block of the README and of docs/ runs as given.

Each document runs top to bottom in a fresh folder, as a user would paste it: `sh` blocks in bash
(`set -euo pipefail`), `python` blocks with this interpreter, both with the installed `sluice` on PATH; a
`sluice serve ... &` line starts the real service in the background, and what a document started is
stopped (SIGTERM, as Ctrl-C would) when it ends. `toml` and `json` blocks must parse; `sql` blocks must
be the SQL a shipped pipeline runs. A block may be left out only with a comment right above it,
`<!-- docs: not run: REASON -->` (the two install commands, which CI itself runs; a long benchmark);
`text` blocks are pictures and output.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

from sluice_client import Producer
from tests.support import running_server

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUN = {"sh", "bash", "python"}
PARSED = {"toml", "json", "sql"}
SHOWN = {"text", ""}
_FENCE = re.compile(r"^(\s*)```(\S*)\s*$")
_SKIP = re.compile(r"^<!-- docs: not run: (.+) -->$")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int
    lang: str
    text: str
    skip: str | None

    def __str__(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line} ({self.lang})"


def blocks(path: Path) -> list[Block]:
    found: list[Block] = []
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        if fence is None:
            i += 1
            continue
        start, indent, lang = i, len(fence.group(1)), fence.group(2)
        i += 1
        body: list[str] = []
        while i < len(lines) and lines[i].strip() != "```":
            line = lines[i]
            body.append(line[indent:] if not line[:indent].strip() else line.lstrip())
            i += 1
        above = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        skip = _SKIP.match(above.strip())
        found.append(Block(path, start + 1, lang, "\n".join(body) + "\n", skip.group(1) if skip else None))
        i += 1
    return found


def test_every_block_is_run_or_says_why_not() -> None:
    for path in DOCUMENTS:
        for block in blocks(path):
            assert block.lang in RUN | PARSED | SHOWN, f"{block}: no way to run a {block.lang!r} block"
            if block.lang == "":
                pytest.fail(f"{block}: give the block a language (text for pictures and output)")


def test_parsed_blocks_parse() -> None:
    from ingest.nexmark.queries import SQL, VIEWS_SQL, sql_text

    views = {"schema": "<EVENT_SCHEMA>", "source": "source", "events": "events", "person": "person",
             "auction": "auction", "bid": "bid"}  # fmt: skip
    shipped = {_words(sql_text(name)) for name in SQL} | {
        _words(sql.format(**views)) for sql in VIEWS_SQL.values()
    }
    for path in DOCUMENTS:
        for block in blocks(path):
            if block.skip:
                continue
            if block.lang == "toml":
                tomllib.loads(block.text)
            elif block.lang == "json":
                json.loads(block.text)
            elif block.lang == "sql":
                # the documented query is the one the pipeline runs (tests/test_nexmark.py runs those)
                text = "\n".join(
                    line for line in block.text.splitlines() if not line.lstrip().startswith("--")
                )
                assert _words(text) in shipped, f"{block}: not the SQL a shipped pipeline runs"


def _words(sql: str) -> str:
    """SQL with its layout folded: one space between words, none inside parentheses."""
    return re.sub(r"\(\s+", "(", re.sub(r"\s+\)", ")", " ".join(sql.split())))


def _runnable(path: Path) -> bool:
    return any(b.lang in RUN and not b.skip for b in blocks(path))


@pytest.mark.spark
@pytest.mark.parametrize("path", [p for p in DOCUMENTS if _runnable(p)], ids=lambda p: p.name)
def test_document_runs_as_given(path: Path, tmp_path: Path) -> None:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = str(ROOT)  # the code under test, also for `python -m ingest...` and `sluice`
    env["PYSPARK_PYTHON"] = sys.executable
    env.pop("SLUICE_CA_FILE", None)
    env.pop("SLUICE_TOKEN_FILE", None)
    env.pop("SLUICE_TOKEN", None)
    groups: list[int] = []  # process groups of the blocks: background servers live in them
    try:
        for block in blocks(path):
            if block.skip or block.lang not in RUN:
                continue
            if block.lang == "python":
                command = [sys.executable, "-c", block.text]
            else:
                command = ["bash", "-c", "set -euo pipefail\n" + block.text]
            process = subprocess.Popen(
                command,
                cwd=tmp_path,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
            groups.append(process.pid)
            try:
                out, _ = process.communicate(timeout=300)
            except subprocess.TimeoutExpired:
                process.kill()
                out, _ = process.communicate()
                pytest.fail(f"{block} did not finish in 300 s:\n{out[-3000:]}\n{_logs(tmp_path)}")
            assert process.returncode == 0, (
                f"{block} failed ({process.returncode}):\n{out[-3000:]}\n{_logs(tmp_path)}"
            )
            # what a block that env-exports meant for the next blocks of the same shell: kept
            for name, value in re.findall(r"^export (\w+)=(\S+)$", block.text, re.MULTILINE):
                env[name] = value
    finally:
        _stop(groups)


def _logs(folder: Path) -> str:
    log = folder / "sluice.log"
    if not log.exists():
        return ""
    text = log.read_text()
    if "address in use" in text:  # a default port taken: say by whom, for the next time it happens
        ss = shutil.which("ss")
        listening = (
            subprocess.run([ss, "-ltnp"], capture_output=True, text=True, check=False).stdout if ss else ""
        )
        text += f"\n--- ss -ltnp:\n{listening}\n--- ps:\n{_processes()}"
    return f"--- sluice.log:\n{text[-6000:]}"


def _processes() -> str:
    ps = subprocess.run(["ps", "-eo", "pid,ppid,etimes,args"], capture_output=True, text=True, check=False)
    return "\n".join(line[:300] for line in ps.stdout.splitlines() if "sluice" in line or "ingest" in line)


def _stop(groups: list[int]) -> None:
    """SIGTERM every process a document left running (a served `sluice serve &`), then wait for it."""
    for group in groups:
        try:
            os.killpg(group, signal.SIGTERM)
        except ProcessLookupError:
            continue
    deadline = time.monotonic() + 90  # a stopping service lets Spark drain first
    for group in groups:
        while time.monotonic() < deadline:
            try:
                os.killpg(group, 0)
            except ProcessLookupError:
                break
            time.sleep(0.2)
        else:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGKILL)


def _protocol_example() -> Block:
    (example,) = [b for b in blocks(ROOT / "docs" / "protocol.md") if "IngestStub(channel).Publish" in b.text]
    return example


async def test_the_protocol_example_runs_again_and_ends_with_a_refusal_rather_than_hang(
    tmp_path: Path,
) -> None:
    """docs/protocol.md's raw-gRPC example opened a fixed producer id with fresh=True: run twice against
    one server, the second run's refusal (ALREADY_EXISTS) ended its reader thread while the main thread
    waited on credit for good. It uses an id of its own per run, and an error of the call ends it."""
    text = _protocol_example().text

    def run(source: str) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        return subprocess.run(
            [sys.executable, "-c", source],
            check=False,
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )

    async with running_server(tmp_path / "data", "default") as server:
        source = text.replace("127.0.0.1:50051", server.target)
        assert source != text
        for _ in range(2):  # the same example twice against one server
            done = await asyncio.to_thread(run, source)
            assert done.returncode == 0, done.stdout + done.stderr
        async with Producer(server.target, "default", producer_id="held") as producer:
            await producer.send(b"x")
        held, n = re.subn(r"producer_id=[^,)]+", 'producer_id="held"', source)
        assert n == 1
        refused = await asyncio.to_thread(run, held)  # old: no end (TimeoutExpired)
        assert refused.returncode != 0
        assert "ALREADY_EXISTS" in refused.stderr and "producer 'held' already has records" in refused.stderr
