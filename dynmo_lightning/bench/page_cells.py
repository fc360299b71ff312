"""How the benchmark page writes its numbers: ratios with the multiplication sign, percentages, 95 % intervals."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from dynmo_lightning.plots import TIMES


def ratio(value: float | None) -> str:
    """``value`` as a ratio with the multiplication sign (:data:`~dynmo_lightning.plots.TIMES`), else a dash."""
    return "—" if value is None or not math.isfinite(value) else f"{value:.2f}{TIMES}"


def percent(value: float | None) -> str:
    """``value`` (a fraction) in whole percent, ``"42 %"`` (a dash when it is missing or not finite)."""
    return "—" if value is None or not math.isfinite(value) else f"{100 * value:.0f} %"


def interval(row: Mapping[str, Any], bold: bool = False) -> str:
    """A row's ratio (:func:`ratio`) and its 95 % interval, ``[low, high]`` (the ratio in bold with ``bold``)."""
    text = f"**{ratio(row['ratio'])}**" if bold else ratio(row["ratio"])
    return f"{text} [{row['ratio_low']:.3f}, {row['ratio_high']:.3f}]"
