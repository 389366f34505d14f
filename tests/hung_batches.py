"""State the swap tests share with swap_pipelines, which the service imports anew at every swap
(ingest.spark.pipeline.fresh_import: a module global there would be a new object at each swap, and a
test setting its own import's copy would release nothing). Kept here, a module imported once."""

from __future__ import annotations

import threading

RELEASE_HUNG = threading.Event()
"""What swap_pipelines.hangs_first_batch's batch waits for: set by its test once done."""
HANG_NEXT = threading.Event()
"""Set: the next batch of swap_pipelines.hangs_when_asked hangs until RELEASE_HUNG (one batch: it
clears it)."""
HANGING = threading.Event()
"""Set by swap_pipelines.hangs_when_asked's batch that hangs."""
