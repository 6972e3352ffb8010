"""Worked problems whose answers are computed, and held to what the lesson says.

A lesson's worked problem states its answer in prose ("about 122 days"). A cell beside
it computes the same figure from the library's calculators (`cost`, `bounds`, the
planner) and holds it to the prose with `held`, so a wrong hand calculation fails the
lesson under nbval instead of teaching the wrong number (issue 42). The tolerance is the
prose's own rounding: "121.7" holds a value within 0.05 of it, "8.4e22" one within
0.05e22, "122" one within 0.5."""

from __future__ import annotations

import math
import re

# a stated figure: digits with optional thousands commas and decimals, optional exponent
_FIGURE = re.compile(r"^[+-]?(\d{1,3}(,\d{3})+|\d+)(\.(\d+))?([eE][+-]?\d+)?$")


def rounding_of(stated: str) -> float:
    """Half a unit in the last digit `stated` writes: the error its rounding allows."""
    match = _FIGURE.match(stated.strip())
    if match is None:
        raise ValueError(f"held: {stated!r} is not a figure; write it as the prose does, "
                         f"e.g. '121.7', '190,000' or '8.4e22'")
    decimals = len(match.group(4) or "")
    exponent = int(match.group(5)[1:]) if match.group(5) else 0
    return 0.5 * 10.0 ** (exponent - decimals)


def rounds_to(value: float, stated: str) -> bool:
    """Whether `value`, rounded as the prose rounds `stated`, is `stated`."""
    slack = rounding_of(stated) * (1 + 1e-9)  # float noise on an exact tie
    return math.isfinite(value) and abs(value - float(stated.replace(",", ""))) <= slack


def held(value: float, stated: str, what: str) -> float:
    """Hold a computed `value` to the figure the prose `stated`, to the prose's rounding.

    Prints `what = stated` (so the lesson's output shows each figure its prose quotes)
    and returns `value` for the next step of the problem. A figure that the computation
    does not round to raises an AssertionError naming both numbers."""
    if not rounds_to(value, stated):
        raise AssertionError(f"{what}: the lesson says {stated}, the calculation gives "
                             f"{value:.6g}; fix the prose or the calculation")
    print(f"{what} = {stated}")
    return value
