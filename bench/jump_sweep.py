"""Simulated cost jumps over a grid of pipelines: where the model keeps issue 17 item 6's goals.

Run: python bench/jump_sweep.py [--estimator-params jump_tolerance=1] [--fixed 0,0.1] [--factors 3,4]
                                 [--seeds 4] [--durations 60,90]

For each fixed cost per batch (seconds of a 1 s interval; the per-record cost is set so a batch per
second holds 70k records), each jump factor and each noise level (+-0 or +-50 ms on every batch), 60 s
of `ratecontrol.simulate.simulate_structured` with the `jumps` profile (the cost jumps by the factor
and back every 6 s, at other phases of the interval each time), as in tests/test_estimators.py.
Prints the peak scheduling delay after the first change (goal <= 2 intervals), the batches starved
after it (goal 0) and the utilisation, then how many cases meet both goals. `--seeds` runs each noisy
case with that many noise sequences, `--durations` each case for those run lengths (more changes, at
more phases). Takes a second or two.
"""

from __future__ import annotations

import argparse
import math

from ratecontrol import RateBounds, make_estimator
from ratecontrol.simulate import JUMP_SPACING, Pipeline, simulate_jumps


def _floats(text: str) -> list[float]:
    return [float(part) for part in text.split(",") if part]


def _params(text: str) -> dict[str, float]:
    pairs = (item.split("=", 1) for item in text.split(",") if item)
    return {key.strip(): float(value) for key, value in pairs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fixed", type=_floats, default=[0.0, 0.1, 0.24, 0.4, 0.6])
    parser.add_argument("--factors", type=_floats, default=[3.0, 3.5, 4.0])
    parser.add_argument("--noise", type=_floats, default=[0.0, 0.05], help="seconds either way")
    parser.add_argument("--estimator-params", type=_params, default={}, help="name=value,... for model")
    parser.add_argument("--seeds", type=int, default=1, help="noise sequences per noisy case")
    parser.add_argument("--durations", type=_floats, default=[60.0], help="seconds per run")
    args = parser.parse_args()
    # the first change comes a quarter in, the next JUMP_SPACING intervals later: a run needs room for one
    shortest = JUMP_SPACING / 0.75 + 1
    if args.seeds < 1 or any(not shortest <= d < math.inf for d in args.durations):
        parser.error(f"--seeds must be >= 1 and every --durations value at least {shortest:g} s")
    met = total = 0
    print("fixed s | jump | noise s | seed | run s |  peak | starved |  util | goals")
    for fixed in args.fixed:
        for factor in args.factors:
            for noise in args.noise:
                for seed in range(args.seeds if noise else 1):  # no noise: every seed runs alike
                    for duration in args.durations:
                        pipeline = Pipeline(
                            fixed_cost=fixed, per_record_cost=(1 - fixed) / 70_000, jitter=noise, seed=seed
                        )
                        bounds, params = RateBounds(100.0, math.inf), args.estimator_params
                        estimator = make_estimator("model", bounds=bounds, initial_rate=10_000.0, **params)
                        sim, changes = simulate_jumps(estimator, pipeline, factor, duration=duration)
                        peak = sim.peak_delay_since(changes[0][0])
                        starved = sim.starved_after(changes[0][0])
                        ok = peak <= 2.0 and starved == 0
                        met += ok
                        total += 1
                        verdict = "met" if ok else "MISSED"
                        print(
                            f"{fixed:>7.2f} | x{factor:<3g} | {noise:>7.2f} | {seed:>4} | {duration:>5g} | "
                            f"{peak:>5.2f} | {starved:>7} | {sim.utilisation:>5.1%} | {verdict}"
                        )
    print(f"{met} of {total} cases meet both goals (peak <= 2 intervals, no starved batch)")


if __name__ == "__main__":
    main()
