"""Pipelines: what a Sluice streaming query does with the records, and starting the query.

A pipeline takes the source DataFrame (columns: see ingest.spark.source.SCHEMA_DDL) and returns a
configured DataStreamWriter: the transformations, the sink and its options. It may take a second
argument, a PipelineContext: where the service wants this query's files (a swapped-in pipeline gets a
folder of its own, see PipelineContext.sink_dir). start_query adds what is the service's business: the
checkpoint (unless the pipeline chose one), the trigger and the name.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import os
import sys
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

from py4j.protocol import Py4JError
from pyspark import cloudpickle
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.streaming.query import StreamingQuery
from pyspark.sql.streaming.readwriter import DataStreamWriter
from pyspark.sql.utils import ForeachBatchFunction

from ingest.checkpoints import last_commit_id, last_planned_id
from ingest.config import MAX_TRIGGER_INTERVAL, MIN_TRIGGER_INTERVAL
from ingest.spark.source import (
    OPTION_MAX_RECORDS,
    OPTION_MIN_PARTITION_RECORDS,
    OPTION_MIN_PARTITIONS,
    OPTION_RATE_TARGET,
    OPTION_RATE_TOKEN_FILE,
    OPTION_STREAMS,
    OPTION_TRIGGER_SECONDS,
    PARTITION_RECORDS,
    SOURCE_NAME,
)
from sluice_client.producer import seconds_arg


@dataclass(frozen=True)
class PipelineContext:
    """What the service tells a pipeline that takes a second argument."""

    sink_dir: Path
    """The folder for this query's output, if it writes files. The first query gets DATA_DIR/sink; each
    pipeline swapped in later gets a folder of its own (sink-g1, sink-g2, ...): Spark's file sink skips
    every batch id its folder's _spark_metadata already holds, so a new query (a new checkpoint, batch
    ids from 0 again) writing into an old query's folder would silently drop its first batches."""
    generation: int = 0
    """0 for the service's first query, +1 for every swap kept."""
    streams: tuple[str, ...] = field(default_factory=tuple)
    """The streams the query reads when it starts (streams added later come in as they are added)."""


Pipeline = Callable[..., DataStreamWriter]
"""function(df) or function(df, context: PipelineContext), returning a configured DataStreamWriter."""

_CHECKPOINT = "checkpointLocation"


def parquet_pipeline(sink_dir: str | Path) -> Pipeline:
    """A pipeline appending every record, all columns, to Parquet files under sink_dir."""
    path = str(sink_dir)

    def pipeline(df: DataFrame) -> DataStreamWriter:
        return df.writeStream.format("parquet").outputMode("append").option("path", path)

    return pipeline


def builtin_parquet(df: DataFrame, context: PipelineContext) -> DataStreamWriter:
    """The built-in pipeline: every record, all columns, appended as Parquet under context.sink_dir."""
    return parquet_pipeline(context.sink_dir)(df)


def pipeline_name(pipeline: object) -> str:
    """How errors and logs name a pipeline: "module:qualified.name", as a spec names it (`sluice serve
    --pipeline mypkg.pipelines:enrich`), not its repr ("<function enrich at 0x7f...>", which says
    neither where it lives nor how to give it). A functools.partial is named by its function, a callable
    object by its class. One load_pipeline loaded is named by the spec it was given (the module's
    `enrich = make_pipeline(...)` is "mypkg.pipelines:enrich", not "...:make_pipeline.<locals>.pipeline")."""
    with contextlib.suppress(TypeError):
        given = _GIVEN_AS.get(pipeline)
        if given is not None:
            return given
    if isinstance(pipeline, functools.partial):
        return f"{pipeline_name(pipeline.func)} (a functools.partial)"
    module = getattr(pipeline, "__module__", None)
    qualname = getattr(pipeline, "__qualname__", None)
    if isinstance(module, str) and isinstance(qualname, str):
        return f"{module}:{qualname}"
    kind = type(pipeline)
    return f"{kind.__module__}:{kind.__qualname__} (an instance)"


def takes_context(pipeline: Pipeline) -> bool:
    """Whether `pipeline` takes a second positional argument (the PipelineContext)."""
    try:
        parameters = inspect.signature(pipeline).parameters.values()
    except (TypeError, ValueError):  # a builtin or a C callable: call it as function(df)
        return False
    positional = [
        p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)
    ]
    return len(positional) >= 2 or any(p.kind is p.VAR_POSITIONAL for p in positional)


def load_pipeline(spec: str) -> Pipeline:
    """The pipeline named by "package.module:function" (the function is the pipeline itself), from the
    module's source as it is now: imported anew at every call (fresh_import), so a swap after an edit
    runs the edited code, not the copy an earlier import left in sys.modules.

    Raises ValueError naming the problem: a malformed spec, a module that cannot be imported, a
    missing attribute or one that is not callable.
    """
    module_name, sep, attr_path = spec.partition(":")
    module_name, attr_path = module_name.strip(), attr_path.strip()
    if not sep or not module_name or not attr_path:
        raise ValueError(f"pipeline spec {spec!r} is not of the form 'package.module:function'")
    # a module beside the user, as `python -m` and uvicorn's app:spec find it: `sluice` is an entry
    # point, whose sys.path has the installed packages only
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = fresh_import(module_name)
    except ModuleNotFoundError as exc:
        if exc.name == module_name or module_name.startswith(f"{exc.name}."):
            raise ValueError(f"pipeline spec {spec!r}: no module named {exc.name!r}") from exc
        raise ValueError(f"pipeline spec {spec!r}: module {module_name!r} failed to import: {exc}") from exc
    except (Exception, SystemExit) as exc:
        # SystemExit too: a module that calls sys.exit() (argparse's parse_args() at module level, which
        # sees the service's own argv) ended the service, a swap's import included
        raise ValueError(f"pipeline spec {spec!r}: module {module_name!r} failed to import: {exc!r}") from exc
    target: object = module
    for part in attr_path.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise ValueError(
                f"pipeline spec {spec!r}: module {module_name!r} has no attribute {attr_path!r}"
            ) from None
    if not callable(target):
        raise ValueError(  # noqa: TRY004 - one error type for every bad spec
            f"pipeline spec {spec!r}: {attr_path!r} is a {type(target).__name__}, not a callable pipeline"
        )
    pipeline: Pipeline = target
    with contextlib.suppress(TypeError):  # an object that cannot be a weak key: named by its class
        _GIVEN_AS[pipeline] = f"{module_name}:{attr_path}"
    return pipeline


_GIVEN_AS: weakref.WeakKeyDictionary[object, str] = weakref.WeakKeyDictionary()
"""Pipelines load_pipeline loaded -> the spec they were loaded by (pipeline_name)."""


def fresh_import(name: str) -> ModuleType:
    """Module `name` imported anew from its source, and its functions sent to Spark's Python workers by
    value. importlib.import_module alone returned the copy in sys.modules: a module edited since its
    first import ran its old code at every swap. Not importlib.reload: that runs the new code in the
    old module's namespace, under the query still running until the swap's boundary (its functions
    look their globals up there), and a new version that fails half-way leaves that namespace half
    new. Here the new module is a new object (what ran before keeps its own), and one that fails to
    import leaves the old one in sys.modules. Modules it imports are not imported again.

    Spark reuses its Python workers, and a worker resolves a function pickled by reference (cloudpickle's
    way for an importable module) in the copy of the module it imported first: a UDF of the new version
    ran the old one's code there. By value, the workers run what the driver loaded."""
    if name == "__main__" or name in sys.builtin_module_names:
        return importlib.import_module(name)  # not a file to read again (and __main__ runs the program)
    importlib.invalidate_caches()  # a module file created since the last look is found
    previous = sys.modules.pop(name, None)
    try:
        module = importlib.import_module(name)
    except BaseException:
        if previous is not None:
            sys.modules[name] = previous
        raise
    if getattr(module, "__file__", None):
        cloudpickle.register_pickle_by_value(module)  # type: ignore[no-untyped-call]
    return module


def start_query(
    spark: SparkSession,
    *,
    store_root: str | Path | None,
    streams: Sequence[str],
    pipeline: Pipeline,
    checkpoint_dir: str | Path,
    trigger_seconds: float,
    query_name: str,
    max_records_per_batch: int | None = None,
    rate_target: str | None = None,
    rate_token_file: str | Path | None = None,
    source_options: Mapping[str, str] | None = None,
    context: PipelineContext | None = None,
) -> StreamingQuery:
    """Start a streaming query reading `streams` from the block store at store_root through `pipeline`.

    trigger_seconds is the micro-batch interval (0: start the next batch as soon as one ends; else
    MIN_TRIGGER_INTERVAL to MAX_TRIGGER_INTERVAL, as the service's --trigger-interval; TypeError or
    ValueError naming it otherwise, before anything starts);
    max_records_per_batch caps a batch at whole blocks (see the source's maxRecordsPerBatch);
    rate_target (host:port of the Sluice server) caps each batch at the live rate x trigger interval;
    rate_token_file holds the bearer token the source asks it with (a server with authentication);
    source_options are more of the source's options (a cluster's `receivers`, with store_root None);
    context is handed to a pipeline that takes one (by default: sink_dir is the checkpoint's path with
    "-sink" added).
    """
    trigger_seconds = check_trigger_seconds(trigger_seconds)
    reader = spark.readStream.format(SOURCE_NAME).option(OPTION_STREAMS, ",".join(streams))
    if store_root is not None:
        reader = reader.option("path", str(store_root))
    for name, value in (source_options or {}).items():
        reader = reader.option(name, value)
    if max_records_per_batch is not None:
        reader = reader.option(OPTION_MAX_RECORDS, str(max_records_per_batch))
    # one partition per core, so a batch of a few blocks is not read by one task (PARTITION_RECORDS: a
    # caller may trade that for one task's fixed cost on small batches)
    reader = reader.option(OPTION_MIN_PARTITIONS, str(spark.sparkContext.defaultParallelism))
    if OPTION_MIN_PARTITION_RECORDS not in (source_options or {}):
        reader = reader.option(OPTION_MIN_PARTITION_RECORDS, str(PARTITION_RECORDS))
    if rate_target is not None:
        reader = reader.option(OPTION_RATE_TARGET, rate_target).option(
            OPTION_TRIGGER_SECONDS, str(trigger_seconds)
        )
        if rate_token_file is not None:
            reader = reader.option(OPTION_RATE_TOKEN_FILE, str(rate_token_file))
    df = reader.load()
    if takes_context(pipeline) and context is None:
        checkpoint = Path(checkpoint_dir)
        context = PipelineContext(checkpoint.with_name(f"{checkpoint.name}-sink"), streams=tuple(streams))
    writer = _build(pipeline, df, context)
    if isinstance(writer, StreamingQuery):
        # it ran on beside the service's query: a second reader of the streams, whose commits release
        # their blocks
        writer.stop()
        raise TypeError(
            f"pipeline {pipeline_name(pipeline)} returned a started StreamingQuery (now stopped): return the "
            "DataStreamWriter, without .start(); Sluice starts the query"
        )
    if not isinstance(writer, DataStreamWriter):
        raise TypeError(
            f"pipeline {pipeline_name(pipeline)} returned {type(writer).__name__}, not a DataStreamWriter"
        )
    if not _has_option(writer, _CHECKPOINT):
        writer = writer.option(_CHECKPOINT, str(checkpoint_dir))
    check_file_sink(_option(writer, "path"), _option(writer, _CHECKPOINT) or str(checkpoint_dir))
    millis = round(trigger_seconds * 1000)
    return writer.trigger(processingTime=f"{millis} milliseconds").queryName(query_name).start()


def check_trigger_seconds(value: object) -> float:
    """start_query's trigger_seconds as a float: 0 (back to back), or MIN_TRIGGER_INTERVAL to
    MAX_TRIGGER_INTERVAL seconds as the service's own trigger interval (ServeConfig). TypeError for a
    bool or what is not a number, ValueError for NaN, an infinite or negative one, or one out of that
    range. Only a negative one was refused: NaN and inf failed once the pipeline had been built, with
    round()'s bare "cannot convert float NaN to integer", a bool was an interval (True: 1 s), and 1e-4
    was rounded to 0 ms, batches back to back, unsaid."""
    seconds = seconds_arg("trigger_seconds", value, finite=True)
    if seconds and seconds < MIN_TRIGGER_INTERVAL:
        raise ValueError(
            f"trigger_seconds must be 0 (batches back to back) or at least {MIN_TRIGGER_INTERVAL:g} "
            f"seconds (Spark's trigger counts whole milliseconds), got {value}"
        )
    if seconds > MAX_TRIGGER_INTERVAL:
        raise ValueError(
            f"trigger_seconds must be at most {MAX_TRIGGER_INTERVAL:g} seconds (a day), got {value}"
        )
    return seconds


def _build(pipeline: Pipeline, df: DataFrame, context: PipelineContext | None) -> object:
    """What `pipeline` returns for `df` (and `context`, if it takes one). A SystemExit it raises (a
    CLI's main() called by mistake) is a RuntimeError: no Exception, it went past a swap's rollback and
    ended the service."""
    try:
        return pipeline(df, context) if takes_context(pipeline) else pipeline(df)
    except SystemExit as exc:
        error = RuntimeError(
            f"pipeline {pipeline_name(pipeline)} called sys.exit({exc.code!r}) as it was built"
        )
        raise error.with_traceback(exc.__traceback__) from exc  # the user's line for start_failure


def _fail_batches_that_exit() -> None:
    """Make a foreachBatch function's SystemExit (sys.exit on a bad record, say) fail its batch as any
    error does. PySpark's ForeachBatchFunction and py4j's callback server catch Exception only: the
    SystemExit ended the callback thread without an answer, and the query waited for one for ever (no
    batch, no error; a swap to it was rolled back only at its first-batch timeout)."""
    call = ForeachBatchFunction.call
    if getattr(call, "_sluice_exit_as_error", False):
        return

    @functools.wraps(call)
    def call_failing_on_exit(self: ForeachBatchFunction, jdf: object, batch_id: int) -> None:
        try:
            call(self, jdf, batch_id)
        except SystemExit as exc:
            said = f"the foreachBatch function called sys.exit({exc.code!r}) in batch {batch_id}"
            error = RuntimeError(said)
            self.error = error  # as ForeachBatchFunction keeps an Exception
            raise error.with_traceback(exc.__traceback__) from exc

    call_failing_on_exit._sluice_exit_as_error = True  # type: ignore[attr-defined]
    ForeachBatchFunction.call = call_failing_on_exit  # type: ignore[method-assign]


_fail_batches_that_exit()


def _local_path(path: str) -> Path | None:
    """`path` as a local file system path, or None for another file system (s3a://, hdfs://...)."""
    if "://" in path and not path.startswith("file:"):
        return None
    return Path(path.removeprefix("file://").removeprefix("file:"))


def check_file_sink(path: str | None, checkpoint: str | Path) -> None:
    """Raise ValueError when a query with a fresh checkpoint would write into a file sink that already
    holds batches: Spark's file sink skips every batch id its `_spark_metadata` lists, so the new query's
    first batches would be dropped without a word (a swapped-in pipeline pointed at an earlier
    generation's sink lost 700 of 28,000 acked records that way)."""
    sink = _local_path(path) if path else None
    folder = _local_path(str(checkpoint))
    if sink is None or folder is None:
        return  # not a local file sink (or a table), or a checkpoint elsewhere: nothing to look at here
    try:
        listed = [name for name in os.listdir(sink / "_spark_metadata") if name.split(".")[0].isdigit()]
    except (FileNotFoundError, NotADirectoryError):
        return
    # new: nothing planned either (a batch written to the sink, killed before its commit, is redone
    # from its offsets entry by this very checkpoint: not another query's)
    fresh = last_planned_id(folder) < 0 and last_commit_id(folder) < 0
    if listed and fresh:
        last = max(int(name.split(".")[0]) for name in listed)
        raise ValueError(
            f"the pipeline writes to {path}, a file sink holding batches up to {last} of another query: "
            f"a query with a new checkpoint ({checkpoint}) would have its batches 0..{last} skipped there "
            "(Spark's file sink drops batch ids its _spark_metadata lists): write to a new folder (a "
            "PipelineContext's sink_dir is one per generation)"
        )


def _option(writer: DataStreamWriter, key: str) -> str | None:
    """The value of option `key` the pipeline set (as _has_option finds it), or None."""
    jwrite = getattr(writer, "_jwrite", None)
    if jwrite is not None:
        try:
            field = jwrite.getClass().getDeclaredField("extraOptions")
            field.setAccessible(True)
            found = field.get(jwrite).get(key)
            return str(found.get()) if found.isDefined() else None
        except Py4JError:
            return None
    proto = getattr(writer, "_write_proto", None)
    options = getattr(proto, "options", None)
    if options is not None:
        return next((str(v) for k, v in options.items() if str(k).lower() == key.lower()), None)
    return None


def _has_option(writer: DataStreamWriter, key: str) -> bool:
    """Whether the pipeline already set option `key` (case-insensitive, as Spark treats options).

    Neither writer exposes its options: classic keeps them in a private field of the JVM writer (read
    by reflection), Spark Connect in its request message. Unknown implementations count as unset.
    """
    jwrite = getattr(writer, "_jwrite", None)
    if jwrite is not None:
        try:
            field = jwrite.getClass().getDeclaredField("extraOptions")
            field.setAccessible(True)
            return bool(field.get(jwrite).contains(key))
        except Py4JError:  # Spark changed its internals: fall back to setting ours
            return False
    proto = getattr(writer, "_write_proto", None)
    options = getattr(proto, "options", None)
    if options is not None:
        return any(str(k).lower() == key.lower() for k in options)
    return False
