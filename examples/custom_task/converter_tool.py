"""The tool of the unit-converter task: plain Python, nothing of trl-agentic (imported by `unit_converter.py` next to
it, to show that a task file may import its own modules)."""

from decimal import Decimal


# Metres per unit.
METRES = {"mm": 0.001, "cm": 0.01, "m": 1.0, "km": 1000.0, "in": 0.0254, "ft": 0.3048, "yd": 0.9144, "mi": 1609.344}


def convert(value: float, from_unit: str, to_unit: str) -> str:
    """Convert a length from one unit to another.

    Args:
        value: The number to convert.
        from_unit: Its unit: mm, cm, m, km, in, ft, yd or mi.
        to_unit: The unit to convert to.
    """
    for unit in (from_unit, to_unit):
        if unit not in METRES:
            raise ValueError(f"unknown unit {unit!r}; use one of {', '.join(METRES)}")  # the model reads this
    result = float(value) * METRES[from_unit] / METRES[to_unit]
    return format(Decimal(f"{result:.4g}"), "f")  # 4 significant digits, never 1.2e+04
