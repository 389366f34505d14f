"""Where a new query (a --reset-pipeline, a swap) starts when the old one's last batch reached its file
sink but not its commit log: a query stopped or killed between the two. CI once saw a reset after such
a stop write 4,800 records a second time (tests/test_pipeline_swap.py::
test_a_reset_pipeline_is_a_trial_until_its_first_batch): the reset started at the commit log's end."""

from __future__ import annotations

from pathlib import Path

from ingest.driver import last_commit_named


def offsets(checkpoint: Path, batch: int, end: int) -> None:
    (checkpoint / "offsets").mkdir(parents=True, exist_ok=True)
    (checkpoint / "offsets" / str(batch)).write_text(f'v1\n{{"batchWatermarkMs":0}}\n{{"s":{end}}}\n')


def test_a_batch_the_sink_holds_counts_as_committed(tmp_path: Path) -> None:
    checkpoint, sink = tmp_path / "cp", tmp_path / "sink"
    for batch, end in ((0, 100), (1, 250), (2, 400)):
        offsets(checkpoint, batch, end)
    (checkpoint / "commits").mkdir()
    (checkpoint / "commits" / "0").write_text("v1\n{}\n")
    (sink / "_spark_metadata").mkdir(parents=True)
    (sink / "_spark_metadata" / "0").write_text("v1\n")
    assert last_commit_named(checkpoint, ["s"], sink) == (0, {"s": 100}, {})
    (sink / "_spark_metadata" / "1").write_text("v1\n")  # in the sink; the commit log never said so
    assert last_commit_named(checkpoint, ["s"], sink) == (1, {"s": 250}, {})
    assert last_commit_named(checkpoint, ["s"]) == (0, {"s": 100}, {})  # without the sink: as before
    # a compacted metadata log names its batch too; a sink batch with no offsets entry is not trusted
    (sink / "_spark_metadata" / "1").rename(sink / "_spark_metadata" / "1.compact")
    assert last_commit_named(checkpoint, ["s"], sink) == (1, {"s": 250}, {})
    (sink / "_spark_metadata" / "3").write_text("v1\n")
    assert last_commit_named(checkpoint, ["s"], sink) == (0, {"s": 100}, {})
    # not a file sink (no _spark_metadata), or nothing committed anywhere
    assert last_commit_named(checkpoint, ["s"], tmp_path / "table") == (0, {"s": 100}, {})
    assert last_commit_named(tmp_path / "empty", ["s"], tmp_path / "none") is None
