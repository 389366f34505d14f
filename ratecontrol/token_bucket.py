"""Token bucket: turns a rate (records/s) into credit a receiver may grant now."""

from __future__ import annotations

import math

from ratecontrol.rate import capped, check_rate


class TokenBucket:
    """Tokens accrue at `rate` per second up to `burst`; granting credit takes tokens.

    Pure: the caller passes the time (seconds, any monotonic origin). With rate = inf every request is
    granted in full. The burst bounds how much credit a quiet period can save up, so a rate change is
    felt within about `burst_seconds`.
    """

    def __init__(self, rate: float, *, burst_seconds: float = 0.2, now: float = 0.0) -> None:
        if not (burst_seconds > 0 and math.isfinite(burst_seconds)):
            raise ValueError(f"burst_seconds must be > 0 and finite, got {burst_seconds}")
        self._burst_seconds = burst_seconds
        self._rate = check_rate(capped(rate))
        self._tokens = self.burst
        self._stamp = now

    @property
    def rate(self) -> float:
        return self._rate

    @property
    def burst(self) -> float:
        """Most tokens the bucket holds: one burst interval's worth, at least one record."""
        return max(1.0, self._rate * self._burst_seconds)

    def set_rate(self, rate: float, now: float) -> None:
        """Change the rate from `now` on; tokens accrued at the old rate are kept up to the new burst."""
        self._refill(now)
        self._rate = check_rate(capped(rate))
        self._tokens = min(self._tokens, self.burst)

    def available(self, now: float) -> float:
        """Tokens that could be taken at `now` (inf when unlimited)."""
        self._refill(now)
        return self._tokens

    def take(self, wanted: int, now: float, *, at_least: int = 1) -> int:
        """Take up to `wanted` whole tokens; return how many were taken (0 <= taken <= wanted).

        Takes nothing while fewer than min(wanted, at_least, burst) tokens are there: credit granted a
        few records at a time costs a message per few records on both sides of the wire.
        """
        if wanted <= 0:
            return 0
        self._refill(now)
        if math.isinf(self._tokens):
            return wanted
        if self._tokens < min(wanted, at_least, math.floor(self.burst)):
            return 0
        taken = min(wanted, int(self._tokens))
        self._tokens -= taken
        return taken

    def seconds_until(self, wanted: int, now: float) -> float:
        """How long until `wanted` tokens (capped at the burst) are available; 0 if they are now."""
        self._refill(now)
        need = min(float(wanted), self.burst) - self._tokens
        if need <= 0 or math.isinf(self._rate):
            return 0.0
        return need / self._rate

    def _refill(self, now: float) -> None:
        elapsed = now - self._stamp
        self._stamp = max(self._stamp, now)
        if math.isinf(self._rate):
            self._tokens = math.inf
        elif elapsed > 0:
            self._tokens = min(self.burst, self._tokens + elapsed * self._rate)
