"""The capacity benchmark's measured rows kept in a JSON file (``benchmarks/capacity.py
--save``, ``--load``): plain values only, so nothing is unpickled from a file.

A row keeps what was measured (each process's peak and what it held before the build, per
run) and, of each predicted or measured member, its layout, depth and balance: the
predicted memory is recomputed from the family's profile and the family's calibration
(``fit_of``), which the file keeps too.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from capacity_doc import Row, order  # a sibling

from gpipe.estimate.memory_model import Calibration
from gpipe.layout import Layout
from gpipe.planner import CapacityCheck, Fit, Measured
from gpipe.planner.capacity import fit_of
from gpipe.planner.families import Family

# family name -> (calibration, rows, minutes of the family's run)
Results = dict[str, tuple[Calibration, list[Row], float]]
_CALIBRATION = ("process", "per_layer", "per_stage_layer", "baseline")  # bytes


def _member(fit: Fit) -> dict[str, Any]:
    return {"layout": fit.layout.to_dict(), "depth": fit.depth, "balance": list(fit.balance)}


def _measured(m: Measured | None) -> dict[str, Any] | None:
    if m is None:
        return None
    return {**_member(m.fit), "measured": list(m.measured), "steps": m.steps, "note": m.note,
            "before": list(m.before)}  # fmt: skip


def _row(row: Row) -> dict[str, Any]:
    again = [_measured(m) for m in row.check.again] if row.check is not None else []
    found, bigger = _measured(row.found), _measured(row.bigger)
    return {"kind": row.kind, "minutes": row.minutes, "load": list(row.load),
            "commit": row.commit, "cpu": row.cpu, "predicted": _member(row.fit), "found": found,
            "bigger": bigger, "again": again,
            "launches": row.check.launches if row.check is not None else 0}  # fmt: skip


def save(path: Path, results: Results, budget: float) -> None:
    data = {}
    for name, (overhead, rows, minutes) in results.items():
        calibration = {k: getattr(overhead, k) for k in _CALIBRATION}
        data[name] = {"budget": budget, "minutes": minutes, "calibration": calibration,
                      "rows": [_row(r) for r in rows]}  # fmt: skip
    path.write_text(json.dumps(data, indent=1) + "\n")


def load(path: Path, families: dict[str, Family]) -> Results:
    """The results kept by :func:`save`, each row's predictions recomputed."""
    results = {}
    for name, data in json.loads(path.read_text()).items():
        overhead = Calibration(**{k: float(data["calibration"][k]) for k in _CALIBRATION})
        fit = _refit(families[name], float(data["budget"]), overhead)
        rows = order([_unrow(r, fit) for r in data["rows"]])
        results[name] = (overhead, rows, float(data["minutes"]))
    return results


def kept_calibration(
    paths: list[Path], families: dict[str, Family], name: str
) -> Calibration | None:
    """Family ``name``'s calibration in the first of ``paths`` that keeps it, else None."""
    return next((kept[name][0] for kept in (load(p, families) for p in paths) if name in kept),
                None)  # fmt: skip


def _refit(family: Family, budget: float, overhead: Calibration) -> Callable[[dict], Fit]:
    def fit(d: dict[str, Any]) -> Fit:
        return fit_of(family, Layout.from_dict(d["layout"]), int(d["depth"]), budget=budget,
                      overhead=overhead, balance=[int(b) for b in d["balance"]])  # fmt: skip

    return fit


def _unrow(data: dict[str, Any], fit: Callable[[dict], Fit]) -> Row:
    def measured(d: dict[str, Any] | None) -> Measured | None:
        if d is None:
            return None
        return Measured(fit(d), tuple(map(float, d["measured"])), int(d["steps"]),
                        str(d["note"]), tuple(map(float, d["before"])))  # fmt: skip

    row = Row(
        str(data["kind"]),
        fit(data["predicted"]),
        minutes=float(data["minutes"]),
        load=tuple(map(float, data.get("load", ()))),
        commit=str(data.get("commit", "")),
        cpu=float(data.get("cpu", 0.0)),
    )
    row.found, row.bigger = measured(data["found"]), measured(data["bigger"])
    if row.found is not None:
        again = tuple(measured(d) for d in data["again"])
        row.check = CapacityCheck(row.found, row.bigger, row.fit, again,
                                  int(data.get("launches", 0)))  # fmt: skip
    return row
