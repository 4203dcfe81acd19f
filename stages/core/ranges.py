"""The valid range of a numeric config key, declared beside its field in stages/core/config.py:

    steps: Annotated[int, AT_LEAST_ONE] = 1000

`stages.core.config.RANGES` collects them; `lorapipe keys` prints each one, and a value outside its range
is a config error naming the key.
"""

from __future__ import annotations

from dataclasses import dataclass

# train seeds its batch-order generator with seed * 1_000_003 + epoch; torch.Generator.manual_seed
# takes at most 2**64 - 1, so seeds stay below 2**32 (also numpy's legacy seed range).
SEED_MAX = 2**32 - 1
# The largest pixel multiple of the shipped families (VAE x8, 2x2 patches): no bucket fits below it.
MIN_RESOLUTION = 16


@dataclass(frozen=True)
class Range:
    """A closed or half-open interval of valid numbers; `str()` is how messages state it."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def __contains__(self, value: float) -> bool:
        above = self.low is None or (value > self.low if self.low_open else value >= self.low)
        below = self.high is None or (value < self.high if self.high_open else value <= self.high)
        return above and below

    def __str__(self) -> str:
        if self.high is None:
            return f"{'>' if self.low_open else '>='} {_number(self.low)}"
        return (f"in {'(' if self.low_open else '['}{_number(self.low)}, {_number(self.high)}"
                f"{')' if self.high_open else ']'}")


def _number(x: float | None) -> str:
    return str(int(x)) if x is not None and float(x).is_integer() else str(x)


POSITIVE = Range(0, low_open=True)
NON_NEGATIVE = Range(0)
AT_LEAST_ONE = Range(1)
FRACTION = Range(0, 1, high_open=True)
