"""Control under cost jumps with real Spark: sluice serve's default control (the model estimator from an
unlimited start) under a saturating publisher while the pipeline's per-record cost jumps 3.5x and back
mid-batch. Its holds (credit withheld, reason rate_hold) and drain batches (RateStatus.
drain_batch_records) depend on when Spark plans and completes batches: no batch stalls, the hold is
released, and every acked record reaches the sink exactly once. (The figures: bench/control_loop.py.)"""

from __future__ import annotations

import asyncio
import math
import time
from pathlib import Path
from typing import Any

from jump_pipelines import factor_file
from live_service import Load, service, wait_for_offsets

from ingest.config import RateConfig
from receivers.receiver import RATE_HOLD


async def test_a_cost_that_jumps_and_falls_back_mid_batch_stalls_nothing(spark: Any, tmp_path: Path) -> None:
    factor = factor_file(tmp_path / "sink")
    factor.write_text("1")
    model = RateConfig(estimator="model", initial_rate=math.inf)
    async with service(spark, tmp_path, "events", pipeline="jump_pipelines:costly", rate=model) as server:
        load = Load(server.target, "events", per_tick=2000)  # ~100k records/s offered: saturating
        pushing = asyncio.create_task(load.run())
        try:
            # past the start: its unmeasured batches take what the receivers hold, which a slow pipeline
            # drains at the minimum rate before the model paces intake (a separate, known transient)
            deadline = time.monotonic() + 150
            while not 1000 < server.rate.rate < math.inf and time.monotonic() < deadline:
                await asyncio.sleep(0.5)
            assert 1000 < server.rate.rate < math.inf, f"no steady rate after the start: {server.rate.rate}"
            await asyncio.sleep(3)
            starts: list[float] = []
            for step in ("3.5", "1", "3.5", "1"):
                await asyncio.sleep(4.3)  # off the 0.5 s trigger grid: changes land mid-batch
                factor.write_text(step)
                starts.append(time.monotonic())
            await asyncio.sleep(6)
        finally:
            load.stop()
            await pushing
        receiver = server.receivers["events"]
        offsets = await wait_for_offsets(spark, load.sent, tmp_path / "sink", timeout=180)
        assert sorted(offsets) == list(range(load.sent))  # every acked record once
        assert RATE_HOLD not in receiver.paused  # whatever was held is released
        # batches went on through the changes: acks never stopped for long (a stalled query would
        # keep the credit and so the acks stopped: nothing is acked while the buffer is full)
        assert load.longest_ack_pause(starts[0], starts[-1] + 6) < 10
