"""edgemoe.convert: a Hugging Face checkpoint -> a store (pipeline.py), with per-expert widths
searched under a quality budget (budget.py), written atomically (writer.py).

    from edgemoe.convert import convert, QualityBudget
    convert("mixtral-dir", "mixtral.store", bits=4, calib_text=open("calib.txt").read())
    convert("mixtral-dir", "mixtral.store", budget=QualityBudget(0.05), calib_text=...)
"""

from .pipeline import ConvertReport, QualityBudget, convert
from .writer import check_destination, read_widths

__all__ = ["ConvertReport", "QualityBudget", "check_destination", "convert", "read_widths"]
