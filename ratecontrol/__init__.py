"""Pure rate-control logic: rates in, credit out. No gRPC, no Spark, no I/O; time is passed in."""

from ratecontrol.rate import UNLIMITED, InvalidRateError, check_rate
from ratecontrol.token_bucket import TokenBucket

__all__ = ["UNLIMITED", "InvalidRateError", "TokenBucket", "check_rate"]
