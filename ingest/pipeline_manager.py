"""The running Spark query's lifecycle: swapping the pipeline and changing the trigger while intake goes on.

A swap (Admin.SwapPipeline, `sluice pipeline swap`) or a new trigger interval (`sluice config set
trigger-interval=...`) replaces the query at a batch boundary:

1. Hold: the server tells the source to plan no new batch (RateStatus.hold_batches); the batch that
   runs finishes and commits; the old query stops between batches. The receivers take and ack records
   the whole time: they never wait for Spark, the blocks wait in the log.
2. Start the new query. Without keep_state it gets a checkpoint (and a sink folder) of its own and
   starts at the old checkpoint's last committed end offsets (the source's startingOffsets): nothing
   processed twice, nothing skipped. With keep_state it continues the old checkpoint (offsets and
   operator state, where Spark deems the new plan compatible).
3. Prove it: the new query must complete its first batch within the timeout. If it fails to start, fails
   that batch or runs out of time, it is stopped and the old query starts again on its own checkpoint,
   where it left off: a rollback, reported with the new query's error. A query found, once stopped, to
   have committed a batch all the same is started again instead (the swap is done): the blocks that
   batch read are released, and the old query could not plan over them.

DATA_DIR/pipeline.json records the generation in force, written before the new query starts with
"trial" set and again once it is proven: a crash mid-swap restarts the new query if it committed a batch
(its output exists, so going back would process those records twice), else the old one. A generation
`--reset-pipeline` starts is a trial the same way, promoted once it commits a batch: one that fails at
its first start (or has committed nothing when the service stops) gives the next start the generation it
replaced, also when a swap away from it was under way (its record goes along with the swap's).

The manager runs the query of a single node (`sluice serve`: its SluiceServer is the QueryHost) and of a
cluster's driver (ingest.cluster_driver.ClusterDriver): the host holds batches back, resets the rate's
warm-up, and says which streams a query reads and whether records wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import glob
import logging
import pickle
import re
import time
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ingest.checkpoints import last_commit_id, last_planned_id
from ingest.driver import QueryPlan, SparkDriver, last_commit, last_commit_named
from ingest.pipeline_control import (
    BOUNDARY_TIMEOUT,
    DEFAULT_FIRST_BATCH_TIMEOUT,
    InvalidPipeline,
    PipelineError,
    PipelineUnavailable,
    SwapInProgress,
    SwapRolledBack,
)
from ingest.pipeline_state import (
    STATE_FILE,
    Generation,
    Outcome,
    PipelineState,
    PipelineStateError,
    Trial,
    in_force,
    read_state,
    write_state,
)
from ingest.spark.listener import BatchCompleted
from ingest.spark.pipeline import Pipeline, PipelineContext, builtin_parquet, load_pipeline
from sluice_client.pb.ingest.v1 import ingest_pb2 as pb

if TYPE_CHECKING:
    from ingest.rate_controller import RateController

log = logging.getLogger(__name__)

POLL = 0.05


class QueryHost(Protocol):
    """What the manager needs of the process that runs the query (SluiceServer, ClusterDriver)."""

    hold_batches: bool
    """While True the source plans no new batch (RateStatus.hold_batches): a swap's batch boundary."""

    @property
    def rate(self) -> RateController: ...

    def query_streams(self) -> tuple[str, ...]:
        """The streams a query started now reads."""
        ...

    def known_streams(self) -> Sequence[str]:
        """Every stream a committed offset may name."""
        ...

    def unread(self, start: Mapping[str, int]) -> bool:
        """Whether records wait past `start` (a query's end offsets, as last_commit gives them)."""
        ...


class PipelineManager:
    """PipelineControl for `sluice serve` and a cluster's driver: owns the query from start to stop."""

    def __init__(
        self,
        driver: SparkDriver,
        host: QueryHost,
        loop: asyncio.AbstractEventLoop,
        *,
        preloaded: Mapping[str, Pipeline] | None = None,
    ) -> None:
        """`preloaded`: spec -> its pipeline function as the caller loaded it already at this start
        (`sluice serve` checks the flag's before Spark starts): start() runs it for the generation in
        force of that spec rather than import its module once more. A swap still loads anew."""
        self._driver = driver
        self._host = host
        self._loop = loop
        config = driver.config
        self._data_dir = config.data_dir
        self._checkpoints = config.checkpoint_dir
        self._path = config.data_dir / STATE_FILE
        self.trigger_interval = config.trigger_interval
        self._lock = asyncio.Lock()
        self._state = "starting"
        """"starting" until start() has started the first query (the Admin service answers meanwhile),
        then "running", "swapping" during a swap or restart, "failed"; "stopped" if the start failed."""
        self._in_force_checkpoint: Path | None = None
        """During a swap or restart, the checkpoint of the query in force when it began (view() shows it
        with that generation, not the checkpoint of the query being tried)."""
        self._failure: str | None = None
        self._last_swap: pb.PipelineSwap | None = None
        self._changes: dict[tuple[str, str], int] = {}
        self._batches: dict[str, BatchCompleted] = {}  # run id -> its last completed batch
        self._batch_seen = asyncio.Event()
        self._replacing: asyncio.Task[pb.PipelineView] | None = None
        self._trial: Trial | None = None
        self._loaded: dict[tuple[str, int, str], Pipeline] = {}
        """The pipeline function each generation was loaded with (_pipeline_of): a restart for a new
        trigger interval, a rollback to the old query and a try kept after all run that code, not an
        edit of its module made since (load_pipeline imports the module anew)."""
        self.current = Generation(config.pipeline or "", 0, driver.query_name, "sink")
        self._load()
        loaded = (preloaded or {}).get(self.current.spec) if self.current.spec else None
        if loaded is not None:
            self._loaded[self._key(self.current)] = loaded
        driver.on_batch(self._on_batch_thread)

    # ---- persistence ------------------------------------------------------------------------------

    def _load(self) -> None:
        state = read_state(self._path)
        if state is None:
            return
        current = state.current
        if state.trial is not None:
            current = self._after_trial(state)
            self._persist(current, None)
        flag = self.current.spec  # --pipeline ("": the built-in sink)
        if current.spec != flag and self._driver.config.reset_pipeline:
            current = self._reset_to(flag, current)
        elif current.spec != flag:
            # as runtime-config.json overrides the flags: the swap stands, and says so
            log.warning(
                "pipeline %s (generation %d, swapped in at run time; %s) runs, not --pipeline %s: "
                "`sluice pipeline swap` changes it while running, `--reset-pipeline` at the start",
                current.spec or "built-in",
                current.number,
                self._path,
                flag or "(built-in)",
            )
        elif current.spec:
            log.info(
                "pipeline %s (generation %d, swapped in at run time; %s)",
                current.spec,
                current.number,
                self._path,
            )
        self.current = current

    def _after_trial(self, state: PipelineState) -> Generation:
        """The generation to run after a stop (a crash, say) with a trial in pipeline.json (a swap's or
        a reset's new generation, not proven yet): pipeline_state.in_force's, said in the log."""
        trial = state.trial
        assert trial is not None
        current, outcome = in_force(state, self._checkpoints)
        if outcome is Outcome.KEPT:
            log.info(
                "pipeline %s (generation %d) committed a batch before the restart: kept",
                current.spec or "built-in",
                current.number,
            )
            return current
        log.info(
            "the swap to %s did not complete before the restart: back to %s",
            trial.generation.spec or "built-in",
            trial.previous.spec or "built-in",
        )
        if outcome is Outcome.BEFORE_RESET:
            log.info(
                "pipeline %s (generation %d, --reset-pipeline) committed no batch before the restart: back "
                "to %s (generation %d)",
                trial.previous.spec or "built-in",
                trial.previous.number,
                current.spec or "built-in",
                current.number,
            )
        return current

    def _reset_to(self, spec: str, saved: Generation) -> Generation:
        """--reset-pipeline: `spec` as a new generation, fresh checkpoint and sink, starting where the
        saved generation's committed batches end (as a swap starts): nothing processed twice, nothing
        skipped. What the saved one planned and did not commit is processed by the new one. Saved as a
        trial, as a swap's new query is: until it commits a batch, the next start runs `saved` again."""
        number = saved.number + 1
        new = Generation(spec, number, *self._fresh_folders(number))
        for folder in (self._checkpoints / new.checkpoint, self._data_dir / new.sink):
            try:
                _set_aside(folder)  # a failed try of this number: its commits would be replayed
            except OSError as exc:
                raise PipelineStateError(f"--reset-pipeline cannot set {folder} aside: {exc}") from None
        # the saved generation's last run may have ended between its sink's commit and its commit log's
        sink = self._data_dir / saved.sink
        committed = last_commit_named(self._checkpoints / saved.checkpoint, self._host.known_streams(), sink)
        new = _starting_at(new, saved, committed)
        base = last_commit_id(self._checkpoints / new.checkpoint)
        self._persist(new, saved, trial_base=base)
        self._trial = Trial(new, saved, base)
        log.warning(
            "--reset-pipeline: %s starts as generation %d where %s (generation %d, swapped in at run "
            "time) committed%s",
            spec or "the built-in sink",
            number,
            saved.spec or "the built-in sink",
            saved.number,
            f" ({', '.join(f'{k}={v}' for k, v in sorted(start.items()))})"
            if (start := new.starting_offsets)
            else "",
        )
        return new

    def _fresh_folders(self, number: int) -> tuple[str, str]:
        """Checkpoint and sink folder names for generation `number` that no earlier try used. A try
        rolled back after its stop timed out (spark.sql.streaming.stopTimeout) leaves its query running,
        and that query goes on writing by path: into its checkpoint (a commit file) and its sink. In
        folders a later try of the same number took again, its commit would mark the new query's batch
        done and its output would land in the new sink. So a number tried before gets "-try<k>"."""
        checkpoint, sink = f"{self._driver.query_name}-g{number}", f"sink-g{number}"
        tries = 1
        while True:
            suffix = f"-try{tries}" if tries > 1 else ""
            names = f"{checkpoint}{suffix}", f"{sink}{suffix}"
            if not (_used(self._checkpoints / names[0]) or _used(self._data_dir / names[1])):
                return names
            tries += 1

    def _persist_in_force(self, current: Generation) -> None:
        """pipeline.json with `current` in force and no swap under way; a --reset-pipeline generation
        that has not committed a batch yet stays a trial."""
        trial = self._trial
        if trial is not None and trial.generation == current:
            self._persist(current, trial.previous, trial.base)
        else:
            self._persist(current, None)

    def _persist_swap_trial(self, new: Generation, old: Generation, base: int) -> None:
        """pipeline.json before a swap's new query starts: `new` a trial over `old`, and `old`'s own
        trial record along when it is a --reset-pipeline generation in trial (it committed nothing:
        _stop_at_boundary promoted it otherwise)."""
        trial = self._trial
        self._persist(
            new, old, base, replaced_trial=trial if trial is not None and trial.generation == old else None
        )

    def _promote_if_committed(self) -> None:
        """The --reset-pipeline generation in trial is kept for good once it has committed a batch."""
        trial = self._trial
        if trial is None or last_commit_id(self._checkpoints / trial.generation.checkpoint) <= trial.base:
            return
        try:
            self._persist(trial.generation, trial.previous)
        except OSError as exc:
            log.warning("%s: the reset pipeline stays a trial until its next batch: %s", self._path, exc)
            return
        self._trial = None
        log.info(
            "pipeline %s (generation %d, --reset-pipeline) committed its first batch: kept",
            trial.generation.spec or "built-in",
            trial.generation.number,
        )

    def _persist(
        self,
        current: Generation,
        previous: Generation | None,
        trial_base: int | None = None,
        *,
        replaced_trial: Trial | None = None,
    ) -> None:
        """pipeline.json (pipeline_state.write_state)."""
        write_state(self._path, current, previous, trial_base, replaced_trial=replaced_trial)

    # ---- the query -------------------------------------------------------------------------------

    @staticmethod
    def _key(generation: Generation) -> tuple[str, int, str]:
        return (generation.spec, generation.number, generation.checkpoint)

    def _pipeline_of(self, generation: Generation) -> Pipeline:
        """`generation`'s pipeline function: as loaded for it, else loaded now from its module's
        source (InvalidPipeline if its spec does not load)."""
        if not generation.spec:
            return builtin_parquet
        loaded = self._loaded.get(self._key(generation))
        if loaded is None:
            try:
                loaded = load_pipeline(generation.spec)
            except ValueError as exc:
                raise InvalidPipeline(str(exc)) from None
            self._loaded[self._key(generation)] = loaded
        return loaded

    def _plan(self, generation: Generation, trigger: float) -> QueryPlan:
        """The driver's plan for `generation` (InvalidPipeline if its spec does not load)."""
        pipeline = self._pipeline_of(generation)
        streams = self._host.query_streams()
        return QueryPlan(
            pipeline=pipeline,
            checkpoint=self._checkpoints / generation.checkpoint,
            trigger_interval=trigger,
            streams=streams,
            starting_offsets=generation.starting_offsets,
            starting_incarnations=generation.starting_incarnations,
            context=PipelineContext(self._data_dir / generation.sink, generation.number, streams),
        )

    async def start(self) -> None:
        """Start the generation in force (at service start). Raises PipelineStateError when its
        pipeline does not load, else what Spark raises."""
        try:
            plan = self._plan(self.current, self.trigger_interval)
        except InvalidPipeline as exc:
            swapped = f", swapped in at run time: {self._path}" if self.current.number else ""
            raise PipelineStateError(
                f"the pipeline in force (generation {self.current.number}{swapped}) does not load: {exc}; "
                "make its module importable here (PYTHONPATH) and start again"
            ) from None
        try:
            await asyncio.to_thread(self._driver.start, plan)
        except Exception as exc:
            self._state = "stopped"
            # the pipeline's own error (its build function raised, a UDF does not pickle, Spark refused
            # its plan) is the user's to fix: one line naming it and where, not a traceback
            log.debug("the pipeline in force did not start", exc_info=True)
            why = start_failure(exc, plan.pipeline)
            spec = self.current.spec or "built-in"
            raise PipelineStateError(f"the pipeline {spec} did not start: {why}") from exc
        except BaseException:
            self._state = "stopped"
            raise
        self._state = "running"

    def failure(self) -> str | None:
        """Why the service must stop: the query died outside a swap, or a rollback could not restart it."""
        if self._failure is not None:
            return self._failure
        if self._lock.locked():
            return None  # a swap stops and starts queries: not a failure until it says so
        return self._driver.error()

    def _on_batch_thread(self, batch: BatchCompleted) -> None:  # on a py4j thread
        if not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._on_batch, batch)

    def _on_batch(self, batch: BatchCompleted) -> None:
        self._batches[batch.run_id] = batch
        self._batch_seen.set()
        # not while a swap runs: a keep_state swap's new query commits into the reset generation's
        # checkpoint, and promoting then would overwrite the swap's own trial in pipeline.json (the
        # swap's boundary promotes what the reset generation committed before it stopped)
        if self._trial is not None and self._state != "swapping":
            self._promote_if_committed()

    # ---- PipelineControl -------------------------------------------------------------------------

    @property
    def changes(self) -> Mapping[tuple[str, str], int]:
        return self._changes

    @property
    def generation(self) -> int:
        return self.current.number

    def _count(self, kind: str, outcome: str) -> None:
        self._changes[(kind, outcome)] = self._changes.get((kind, outcome), 0) + 1

    def view(self) -> pb.PipelineView:
        query = self._driver.query
        # the generation in force, its folders and its query, all of one generation: during a swap the
        # driver's checkpoint is the try's (checkpoint sluice-g3 was shown beside generation 2 and sink-g2)
        swapping = self._state == "swapping"
        checkpoint = self._in_force_checkpoint if swapping else self._driver.checkpoint
        view = pb.PipelineView(
            pipeline=self.current.spec,
            generation=self.current.number,
            state=self._state if self._failure is None else "failed",
            checkpoint=str(checkpoint or self._checkpoints / self.current.checkpoint),
            trigger_interval_seconds=self.trigger_interval,
            query_id=str(query.id) if query is not None and not swapping else "",
            sink_dir=str(self._data_dir / self.current.sink),
        )
        if self._state == "running" and self._driver.error() is not None:
            view.state = "failed"
        if self._last_swap is not None:
            view.last_swap.CopyFrom(self._last_swap)
        return view

    async def swap(self, spec: str, *, keep_state: bool, first_batch_timeout: float) -> pb.PipelineView:
        spec = spec.strip()
        pipeline = None
        if spec:
            try:
                # the module's source as it is now (an edit since an earlier swap to it counts): may
                # take a while; the query that runs keeps the code it was started with
                pipeline = await asyncio.to_thread(load_pipeline, spec)
            except ValueError as exc:
                raise InvalidPipeline(str(exc)) from None
        old = self.current
        number = old.number + 1
        if keep_state:
            new = Generation(
                spec,
                number,
                old.checkpoint,
                old.sink,
                old.starting_offsets,
                kept_state=True,
                starting_incarnations=old.starting_incarnations,
            )
        else:
            new = Generation(spec, number, *self._fresh_folders(number))
        if pipeline is not None and not self._lock.locked():  # (locked: refused as a swap under way)
            # what _plan starts, not imported a second time; of the others, only the generation in
            # force can run again (a rollback, a restart)
            kept = self._key(self.current)
            self._loaded = {k: v for k, v in self._loaded.items() if k == kept}
            self._loaded[self._key(new)] = pipeline
        return await self._replace(new, self.trigger_interval, first_batch_timeout, what="swap")

    async def restart(self, *, trigger_interval: float) -> None:
        await self._replace(self.current, trigger_interval, DEFAULT_FIRST_BATCH_TIMEOUT, what="restart")

    async def _replace(
        self, new: Generation, trigger: float, timeout: float, *, what: str
    ) -> pb.PipelineView:
        if self._lock.locked():
            raise SwapInProgress("a pipeline swap or restart is under way: try again when it is done")
        await self._lock.acquire()  # free: taken at once, released by the task when it ends
        # The task runs to its end whatever becomes of this call: a client that goes away (Ctrl-C, its
        # deadline) cancels the call, and a swap cut there left its threads starting and stopping queries
        # with the lock free and neither `current` nor pipeline.json updated: the next swap took the same
        # generation, set the running query's checkpoint aside and started over released blocks.
        task = asyncio.create_task(self._replace_held(new, trigger, timeout, what=what))
        self._replacing = task
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if not task.done():
                log.warning("the caller of the %s went away: the %s goes on to its end", what, what)
                task.add_done_callback(_said_when_alone)
            raise

    async def settled(self, timeout: float) -> None:
        """Wait up to `timeout` s for a swap or restart under way (its caller may have gone) to end: at
        shutdown, before the query is drained and stopped under it."""
        task = self._replacing
        if task is None or task.done():
            return
        log.info("waiting for the pipeline swap under way to end (at most %g s)", timeout)
        _, late = await asyncio.wait([task], timeout=timeout)
        if late:
            log.warning(
                "the pipeline swap did not end within %g s: stopping anyway (pipeline.json has it as a "
                "trial: the next start keeps the new query only if it committed a batch)",
                timeout,
            )

    def _begin_swapping(self) -> None:
        """State "swapping"; view() shows the query in force (its checkpoint) until the swap ends."""
        self._in_force_checkpoint = self._driver.checkpoint
        self._state = "swapping"

    async def _replace_held(
        self, new: Generation, trigger: float, timeout: float, *, what: str
    ) -> pb.PipelineView:
        """_replace, with the lock held: released when it ends."""
        try:
            query = self._running_query()
            timeout = timeout if timeout > 0 else DEFAULT_FIRST_BATCH_TIMEOUT
            old, old_trigger = self.current, self.trigger_interval
            requested = time.time()
            self._begin_swapping()
            old_id = str(query.runId)
            if new.checkpoint != old.checkpoint:
                # a failed try of this generation number left its folders: its checkpoint would
                # replay the try's planned batch from where the old query stood then, and a file
                # sink skips batch ids its metadata already lists. Before the old query stops.
                try:
                    for folder in (self._checkpoints / new.checkpoint, self._data_dir / new.sink):
                        _set_aside(folder)
                except OSError as exc:
                    self._state = "running"
                    raise PipelineUnavailable(f"nothing was stopped: {exc}") from None
            await self._stop_at_boundary()
            stopped = time.time()
            old_checkpoint = self._checkpoints / old.checkpoint
            old_sink = self._data_dir / old.sink
            committed = last_commit_named(old_checkpoint, self._host.known_streams(), old_sink)
            old_end = self._batch_end(old_id)
            fresh = new.checkpoint != old.checkpoint
            if fresh:
                # where the old query's committed batches end; nothing committed: where it started
                new = _starting_at(new, old, committed)
            base = last_commit_id(self._checkpoints / new.checkpoint)
            if what == "swap":
                self._persist_swap_trial(new, old, base)
            try:
                new_id, started = await self._prove(new, trigger, timeout, base)
            except Exception as exc:  # noqa: BLE001 - whatever the new query raised, the old one comes back
                error = start_failure(exc, self._loaded.get(self._key(new)))
                log.error(  # noqa: TRY400 - said in one line, the pipeline's own error
                    "%s to %s failed, rolling back to %s: %s",
                    what,
                    new.spec or "built-in",
                    old.spec or "built-in",
                    error,
                )
                self._count(what, "rolled_back")
                await self._roll_back(old, old_trigger, tried=new if fresh else None)
                self._last_swap = self._record(old, new, "rolled back", error, requested, old_end, None)
                raise SwapRolledBack(
                    f"{what} rolled back, the old pipeline runs again: {error}", self.view()
                ) from None
            if what == "swap":
                self._persist(new, old)
                self._trial = None  # the old generation, a reset one in trial or not, is history now
            self.current, self.trigger_interval = new, trigger
            self._state = "running"
            self._count(what, "done")
            self._last_swap = self._record(old, new, "done", "", requested, old_end, self._batch_end(new_id))
            self._last_swap.boundary_seconds = stopped - requested
            first = self._batches.get(new_id)
            if first is not None:
                self._last_swap.startup_seconds = max(0.0, first.started_at - started)
            log.info(
                "%s done: pipeline %s (generation %d), trigger %g s, first batch after %.1f s",
                what,
                new.spec or "built-in",
                new.number,
                trigger,
                self._last_swap.duration_seconds,
            )
            return self.view()
        finally:
            self._lock.release()

    def _running_query(self) -> Any:
        """The query a swap or restart replaces; PipelineUnavailable if none runs."""
        if self._state == "starting" and self._failure is None:
            # attached before start() (Spark's workers warm up first): a query is on its way
            raise PipelineUnavailable("the query is still starting; try again in a few seconds")
        query = self._driver.query
        if query is None or self._failure is not None:
            raise PipelineUnavailable("no Spark query runs here")
        return query

    async def _prove(self, new: Generation, trigger: float, timeout: float, base: int) -> tuple[str, float]:
        """_start_and_prove; but a query that failed or ran out of time and is found, once stopped, to
        have committed a batch beyond `base` (its checkpoint's last commit before it started) is kept:
        started again on its checkpoint."""
        for attempt in (1, 2):
            try:
                return await self._start_and_prove(new, trigger, timeout)
            except Exception as exc:
                if await self._committed_after_all(new, base):
                    return await self._restart_committed(new, trigger, _describe(exc))
                if attempt == 2 or WORKER_LATE not in getattr(exc, "spark_error", str(exc)):
                    raise
                # Spark gives a Python worker a fixed 10 s to connect back (PythonWorkerFactory): a
                # loaded machine misses it now and then, and the swap rolled back for nothing
                log.warning("%s; starting the new query once more", _describe(exc))
        raise AssertionError  # pragma: no cover - the second attempt returned or raised

    async def _committed_after_all(self, new: Generation, base: int) -> bool:
        """Stop the new query, then say whether it committed a batch all the same (after the deadline,
        or before it failed and before the manager heard of that batch). The blocks such a batch read
        were released when it committed: the old query, started again at its own end, would fail to
        plan over them (the service's query then stops), and the records are in the new sink."""
        await asyncio.to_thread(self._driver.stop_query)
        return last_commit_id(self._checkpoints / new.checkpoint) > base

    async def _restart_committed(self, new: Generation, trigger: float, error: str) -> tuple[str, float]:
        """Start `new` again on its checkpoint: it committed a batch, so it is the query in force (the
        swap is done; if it fails again, it fails as any running query does). Returns its run id and
        when it was started."""
        log.warning("the new query committed a batch, then: %s; it is kept and started again", error)
        self._host.rate.query_started()
        started = time.time()
        await asyncio.to_thread(self._driver.start, self._plan(new, trigger))
        query = self._driver.query
        assert query is not None
        return str(query.runId), started

    def _set_aside_try(self, tried: Generation) -> None:
        """Move a rolled-back try's checkpoint and sink aside; if that fails, the next swap does it."""
        for folder in (self._checkpoints / tried.checkpoint, self._data_dir / tried.sink):
            try:
                _set_aside(folder)
            except OSError as exc:
                log.warning("%s stays where it is (the next swap moves it aside): %s", folder, exc)

    async def _stop_at_boundary(self) -> None:
        """Hold batches, let the one in flight commit, stop the query between batches."""
        driver = self._driver
        self._host.hold_batches = True
        try:
            deadline = time.monotonic() + BOUNDARY_TIMEOUT
            while driver.query is not None and driver.query.isActive:
                if await asyncio.to_thread(self._between_batches):
                    break
                if time.monotonic() > deadline:
                    log.warning(
                        "the query's batch did not finish within %g s: stopping it mid-batch; "
                        "the next query redoes that batch",
                        BOUNDARY_TIMEOUT,
                    )
                    break
                await asyncio.sleep(POLL)
            await asyncio.to_thread(driver.stop_query)
        finally:
            self._host.hold_batches = False
        self._promote_if_committed()  # a reset generation in trial whose batch just committed

    def _between_batches(self) -> bool:
        """Whether no trigger runs and every planned batch is committed (blocking: py4j)."""
        query = self._driver.query
        if query is None or not query.isActive:
            return True
        if query.status.get("isTriggerActive", True):
            return False
        checkpoint = self._driver.checkpoint
        if checkpoint is None:
            return True  # not a local checkpoint: the trigger being idle is all we can see
        return last_planned_id(checkpoint) == last_commit_id(checkpoint)

    async def _start_and_prove(self, new: Generation, trigger: float, timeout: float) -> tuple[str, float]:
        """Start `new` and wait for its first batch; raise why it failed. Returns its run id and when
        (epoch s) it was started."""
        plan = self._plan(new, trigger)
        self._host.rate.query_started()
        started = time.time()
        await asyncio.to_thread(self._driver.start, plan)
        query = self._driver.query
        assert query is not None
        query_id = str(query.runId)  # a restart on the same checkpoint keeps the query id
        deadline = time.monotonic() + timeout
        idle_since: float | None = None
        while query_id not in self._batches:
            if not query.isActive:
                exc = query.exception()
                why = _cause(str(exc)) if exc is not None else "no error given"
                raise StoppedEarly(f"the new query stopped before its first batch: {why}", str(exc or ""))
            now = time.monotonic()
            if now > deadline:
                raise TimeoutError(f"the new query did not complete its first batch within {timeout:g} s")
            # no batch comes while nothing waits (a restart on the same checkpoint with no new data):
            # a query that is up, idle and has nothing to read is proven as far as it can be
            if await asyncio.to_thread(self._idle_with_nothing_to_read, plan):
                idle_since = idle_since or now
                # idle through a trigger: its first (at once at start) has reported progress; else a
                # whole interval, as before a first trigger the query looks idle too. A long interval
                # (a day) must not make an idle service's restart wait for it, past the timeout
                waited = 1.0 if await asyncio.to_thread(_has_progress, query) else trigger + 1.0
                if now - idle_since > waited:
                    log.info("the new query is idle with nothing to read: kept without a first batch")
                    break
            else:
                idle_since = None
            self._batch_seen.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._batch_seen.wait(), 0.2)
        return query_id, started

    def _idle_with_nothing_to_read(self, plan: QueryPlan) -> bool:
        query = self._driver.query
        if query is None or not query.isActive:
            return False
        status = query.status
        if status.get("isTriggerActive", True) or status.get("isDataAvailable", True):
            return False
        committed = last_commit(plan.checkpoint, self._host.known_streams())
        start: Mapping[str, int] = committed[1] if committed is not None else (plan.starting_offsets or {})
        return not self._host.unread(start)

    async def _roll_back(self, old: Generation, trigger: float, *, tried: Generation | None) -> None:
        """Stop the new query and start `old` again; `tried` (a try in folders of its own) has them
        moved aside at once, not at the next swap: a first batch that committed after the timeout left
        records in its sink that the old query processes again."""
        await asyncio.to_thread(self._driver.stop_query)
        if tried is not None:
            self._set_aside_try(tried)
        self._persist_in_force(old)
        self._host.rate.query_started()
        try:
            await asyncio.to_thread(self._driver.start, self._plan(old, trigger))
        except Exception as exc:  # noqa: BLE001 - py4j and PySpark raise many kinds: the service stops
            self._failure = f"the rollback could not restart the old pipeline: {_describe(exc)}"
            self._state = "failed"
            log.error("%s", self._failure)  # noqa: TRY400 - the cause is in the message
            raise PipelineUnavailable(self._failure) from None
        self.current, self.trigger_interval = old, trigger
        self._state = "running"

    def _batch_end(self, run_id: str | None) -> float | None:
        batch = self._batches.get(run_id) if run_id else None
        return batch.started_at + batch.processing_seconds if batch is not None else None

    def _record(  # noqa: PLR0917 - private, one call site each
        self,
        old: Generation,
        new: Generation,
        outcome: str,
        error: str,
        requested: float,
        old_end: float | None,
        new_end: float | None,
    ) -> pb.PipelineSwap:
        swap = pb.PipelineSwap(
            from_pipeline=old.spec,
            to_pipeline=new.spec,
            outcome=outcome,
            error=error,
            requested_at=requested,
            duration_seconds=(new_end if new_end is not None else time.time()) - requested,
            start_offsets=new.starting_offsets or {},
            kept_state=new.kept_state,
        )
        if old_end is not None and new_end is not None:
            # processing the swap paused: from the old query's last batch, or from the request when the
            # old query was idle before it (60 s of idleness counted as a 60.4 s gap of a 2.1 s swap)
            swap.processing_gap_seconds = new_end - max(old_end, requested)
        return swap


def _said_when_alone(task: asyncio.Task[pb.PipelineView]) -> None:
    """Log what a swap whose caller went away raised beyond its own outcomes (which it logs itself)."""
    if task.cancelled():
        log.warning("a pipeline swap or restart whose caller went away was cancelled")
        return
    exc = task.exception()
    if exc is None or isinstance(exc, SwapRolledBack):  # logged as it ended
        return
    if isinstance(exc, PipelineError):
        log.error("a pipeline swap or restart whose caller went away failed: %s", exc)
    else:
        log.error("a pipeline swap or restart whose caller went away failed", exc_info=exc)


def _used(folder: Path) -> bool:
    """A try had `folder`: it is there, or set aside (_set_aside) beside it."""
    return folder.exists() or any(folder.parent.glob(f"{glob.escape(folder.name)}.abandoned-*"))


def _set_aside(folder: Path) -> None:
    """Rename `folder`, if it exists, to the first free "<name>.abandoned-<n>" beside it (kept for the
    operator, never read again)."""
    if not folder.exists():
        return
    n = 1
    while (aside := folder.with_name(f"{folder.name}.abandoned-{n}")).exists():
        n += 1
    folder.rename(aside)
    log.warning("%s was left by a swap that did not complete: moved to %s", folder, aside.name)


def _has_progress(query: Any) -> bool:
    """The query finished a trigger (Spark reports the first one without data at once, later ones every
    spark.sql.streaming.noDataProgressEventInterval)."""
    return query.lastProgress is not None


_CAUSE = re.compile(r"^\s*(?:[A-Za-z_][\w.]*\.)?[A-Z]\w*(?:Error|Exception): .+$")


WORKER_LATE = "Timed out while waiting for the Python worker to connect back"
"""Spark's error when a Python worker it started (the source's planner) did not connect back in 10 s."""


class StoppedEarly(RuntimeError):
    """A new query stopped before its first batch; `spark_error` is Spark's whole error text."""

    def __init__(self, message: str, spark_error: str) -> None:
        super().__init__(message)
        self.spark_error = spark_error


def _describe(exc: BaseException) -> str:
    """An error in one line (see _cause)."""
    return _cause(str(exc).strip() or type(exc).__name__)


_NOT_PICKLED = (
    "; the pipeline module's functions reach Spark's Python workers by value, with the module-level "
    "objects they use: create such an object inside the function, or use it through another module "
    "(import mylib; mylib.LOCK), which travels by reference"
)


def start_failure(exc: BaseException, pipeline: Pipeline | None) -> str:
    """Why a query did not start, in one line: the error, where in the pipeline's own file it was
    raised, and for a function that does not pickle, what to do about it."""
    described = _describe(exc)
    if "Error" not in described.split(":", 1)[0] and "Exception" not in described.split(":", 1)[0]:
        described = f"{type(exc).__name__}: {described}"  # KeyError's own text is the key alone
    code = getattr(pipeline, "__code__", None)
    source = getattr(code, "co_filename", None)
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == source]
    if frames:
        described += f" (at {Path(frames[-1].filename).name} line {frames[-1].lineno})"
    if isinstance(exc, pickle.PicklingError) or "Could not serialize object" in described:
        described += _NOT_PICKLED
    return described


def _cause(text: str) -> str:
    """One line of a Spark error: those are pages of JVM and Python stack, whose last "XError: ..." line
    (the pipeline's own exception, raised in a Python worker) says more than the first."""
    lines = text.splitlines() or [""]
    causes = [line.strip() for line in lines if _CAUSE.match(line)]
    line = causes[-1] if "Traceback (most recent call last)" in text and causes else lines[0]
    return line if len(line) <= 500 else line[:497] + "..."


def _starting_at(
    new: Generation, old: Generation, committed: tuple[int, dict[str, int], dict[str, str]] | None
) -> Generation:
    """`new` starting where `old`'s committed batches end (with the incarnations of the partitions'
    logs that offset is of: a log lost since is DataLossError to the new query, not records skipped);
    nothing committed: where `old` started."""
    if committed is not None:
        start, incarnations = committed[1], committed[2]
    else:
        start, incarnations = old.starting_offsets or {}, old.starting_incarnations or {}
    return replace(
        new,
        starting_offsets=dict(start) if start else None,
        starting_incarnations=dict(incarnations) if start and incarnations else None,
    )
