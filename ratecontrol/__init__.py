"""Pure rate-control logic: rates in, credit out. No gRPC, no Spark, no I/O; time is passed in."""

from ratecontrol.batch import BatchMetrics
from ratecontrol.estimator import (
    DEFAULT_ESTIMATOR,
    ESTIMATORS,
    FixedEstimator,
    RateBounds,
    RateEstimator,
    UnknownEstimatorError,
    check_estimator,
    make_estimator,
)
from ratecontrol.model import ModelEstimator
from ratecontrol.rate import MAX_RATE, UNLIMITED, InvalidRateError, capped, check_rate
from ratecontrol.share import Demand, Share, StreamPolicy, split_rate
from ratecontrol.spark_pid import SparkPIDEstimator
from ratecontrol.token_bucket import TokenBucket

__all__ = [
    "DEFAULT_ESTIMATOR",
    "ESTIMATORS",
    "MAX_RATE",
    "UNLIMITED",
    "BatchMetrics",
    "Demand",
    "FixedEstimator",
    "InvalidRateError",
    "ModelEstimator",
    "RateBounds",
    "RateEstimator",
    "Share",
    "SparkPIDEstimator",
    "StreamPolicy",
    "TokenBucket",
    "UnknownEstimatorError",
    "capped",
    "check_estimator",
    "check_rate",
    "make_estimator",
    "split_rate",
]
