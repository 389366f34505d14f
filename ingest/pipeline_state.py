"""DATA_DIR/pipeline.json: which pipeline generation is in force, and which one a start runs.

The pipeline manager (ingest.pipeline_manager) writes it before a swap's new query starts (a trial) and
again once the query is proven; a `--reset-pipeline` generation is a trial the same way until it commits
a batch. Its format::

    {"current": GENERATION, "previous": GENERATION or null,
     "trial": true when current is not proven yet, "trial_base": the last commit of current's checkpoint
     when it started (-1: none),
     "replaced_trial": {"previous": GENERATION, "trial_base": N}}   (only when a swap replaced a
                                                                     --reset-pipeline generation in trial)

with GENERATION = {"spec", "number", "checkpoint", "sink", "starting_offsets", "kept_state"}, and
"starting_incarnations" when the starting offsets name them (a cluster's: the incarnation of each
partition's log they are of, {"stream/owner": id}; ingest.spark.cluster_source).

in_force() is the one reading of which generation a start runs after a stop in mid-trial: the manager
starts it, and `sluice config check` shows it (reading the file, never writing it). Without Spark.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from ingest.checkpoints import last_commit_id
from receivers.files import parse_json, replace_json

STATE_FILE = "pipeline.json"


class PipelineStateError(ValueError):
    """pipeline.json is unreadable or not one: the start stops, naming it."""


@dataclass(frozen=True)
class Generation:
    """One pipeline in the service's history, as pipeline.json keeps it."""

    spec: str
    """"module:function", or "" for the built-in Parquet sink."""
    number: int
    checkpoint: str
    """Folder under DATA_DIR/checkpoints."""
    sink: str
    """Folder under DATA_DIR for PipelineContext.sink_dir."""
    starting_offsets: dict[str, int] | None = None
    kept_state: bool = False
    starting_incarnations: dict[str, str] | None = None
    """The incarnations of the partitions' logs starting_offsets are of (a cluster's), if known."""

    @staticmethod
    def from_json(data: Any) -> Generation:
        if not isinstance(data, dict):
            raise TypeError("not an object")
        offsets = data.get("starting_offsets")
        incarnations = data.get("starting_incarnations")
        return Generation(
            spec=str(data["spec"]),
            number=int(data["number"]),
            checkpoint=_folder(data["checkpoint"]),
            sink=_folder(data["sink"]),
            starting_offsets=None if offsets is None else {str(k): int(v) for k, v in offsets.items()},
            kept_state=bool(data.get("kept_state", False)),
            starting_incarnations=None
            if not isinstance(incarnations, dict)
            else {str(k): str(v) for k, v in incarnations.items()},
        )


def _folder(name: object) -> str:
    """A plain folder name (no separators, no '..'): the file cannot point the service elsewhere."""
    if not isinstance(name, str) or not name or "/" in name or "\\" in name or name in (".", ".."):
        raise ValueError(f"not a folder name: {name!r}")
    return name


@dataclass(frozen=True)
class Trial:
    """A generation in force that pipeline.json keeps as a trial until it commits a batch past `base`
    (the last commit of its checkpoint when it started) over `previous`, the one it replaced."""

    generation: Generation
    previous: Generation
    base: int


@dataclass(frozen=True)
class PipelineState:
    """pipeline.json as read."""

    current: Generation
    trial: Trial | None
    """`current` as a trial (a swap's or a reset's new generation, not proven yet); None: proven."""
    replaced_trial: Trial | None
    """With `trial`: the generation it replaced was a --reset-pipeline one in trial itself (it committed
    nothing), which the file keeps so that going back from the swap still takes it for a trial."""


def read_state(path: Path) -> PipelineState | None:
    """The pipeline state in `path`; None when there is no such file. PipelineStateError naming the file
    when it cannot be read or is not one (a start must stop on it)."""
    try:
        data = parse_json(path.read_text())
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise PipelineStateError(f"{path}: cannot read the pipeline state: {exc}") from None
    except ValueError as exc:
        raise PipelineStateError(f"{path}: not a pipeline state file: {exc}") from None
    try:
        current = Generation.from_json(data["current"])
        previous = Generation.from_json(data["previous"]) if data.get("previous") else None
        trial_base = int(data.get("trial_base", -1))
        flagged = bool(data.get("trial", False))
        replaced = data.get("replaced_trial")
        replaced_trial = None
        if replaced is not None and previous is not None:  # the swap replaced a reset in trial
            earlier = Generation.from_json(replaced["previous"])
            replaced_trial = Trial(previous, earlier, int(replaced["trial_base"]))
        trial = Trial(current, previous, trial_base) if flagged and previous is not None else None
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise PipelineStateError(f"{path}: not a pipeline state file: {exc}") from None
    return PipelineState(current, trial, replaced_trial if trial is not None else None)


class Outcome(Enum):
    """How in_force() found the generation a start runs."""

    PROVEN = "proven"
    """No trial: the generation in force."""
    KEPT = "kept"
    """The trial committed a batch past its base: its output exists, going back would process those
    records twice."""
    BACK = "back"
    """The trial committed nothing: the generation it replaced."""
    BEFORE_RESET = "before-reset"
    """The trial committed nothing and the one it replaced was a --reset-pipeline generation in trial
    that committed nothing either: the generation the reset replaced."""


def in_force(state: PipelineState, checkpoints: Path) -> tuple[Generation, Outcome]:
    """The generation a start runs (before --reset-pipeline), with how it was found: `checkpoints` is
    DATA_DIR/checkpoints, whose commit logs say whether a trial committed a batch."""
    trial = state.trial
    if trial is None:
        return state.current, Outcome.PROVEN
    if last_commit_id(checkpoints / trial.generation.checkpoint) > trial.base:
        return trial.generation, Outcome.KEPT
    replaced = state.replaced_trial
    if replaced is None or last_commit_id(checkpoints / replaced.generation.checkpoint) > replaced.base:
        return trial.previous, Outcome.BACK
    return replaced.previous, Outcome.BEFORE_RESET


def _json(generation: Generation) -> dict[str, Any]:
    """A generation as pipeline.json keeps it (starting_incarnations only when there are some)."""
    data = asdict(generation)
    if not data.get("starting_incarnations"):
        data.pop("starting_incarnations", None)
    return data


def write_state(
    path: Path,
    current: Generation,
    previous: Generation | None,
    trial_base: int | None = None,
    *,
    replaced_trial: Trial | None = None,
) -> None:
    """pipeline.json: `current` in force, a trial over `previous` when `trial_base` is given (the last
    commit of its checkpoint when it started). `replaced_trial`: a swap's trial replaces a
    --reset-pipeline generation (`previous`) that is a trial itself; kept, so that a start going back
    from the swap still takes that generation for a trial (it committed nothing: the one it replaced
    runs). Written over, the reset's record was lost, and the start kept it for good."""
    data: dict[str, Any] = {
        "current": _json(current),
        "previous": _json(previous) if previous is not None else None,
        "trial": trial_base is not None,
        "trial_base": -1 if trial_base is None else trial_base,
    }
    if replaced_trial is not None:
        data["replaced_trial"] = {
            "previous": _json(replaced_trial.previous),
            "trial_base": replaced_trial.base,
        }
    replace_json(path, data)
