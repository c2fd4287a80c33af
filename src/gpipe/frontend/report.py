"""What loading a checkpoint found, and the error or warning that says it.

A :class:`LoadReport` lists the model's tensors a checkpoint lacks (``missing``, the model's
names), its tensors that are no tensor of the model (``unexpected``, the checkpoint's names),
those of another shape (``mismatched``) and conversions that failed (``failed``). Reports of
several ranks merge into one (:meth:`LoadReport.merged`), so that every rank raises the same
:class:`WeightsError` (first few names and counts, and the remedy), or, with ``strict=False``,
warns of what was initialized instead.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

__all__ = ["LoadReport", "WeightsError"]

Shape = tuple[int, ...]


class WeightsError(ValueError):
    """A checkpoint that does not fill the model: missing, unexpected or mis-shaped tensors
    (``report``: all of them)."""

    def __init__(self, message: str, report: LoadReport) -> None:
        super().__init__(message)
        self.report = report


@dataclass
class LoadReport:
    """What loading a checkpoint into units found (see the module doc); names are sorted."""

    checkpoint: str
    missing: list[str] = field(default_factory=list)  # the model's names
    unexpected: list[str] = field(default_factory=list)  # the checkpoint's names
    mismatched: list[tuple[str, Shape, Shape]] = field(default_factory=list)  # checkpoint, model
    failed: list[str] = field(default_factory=list)  # conversions that raised
    initialized: list[str] = field(default_factory=list)  # strict=False: given other values

    @property
    def complete(self) -> bool:
        return not (self.missing or self.unexpected or self.mismatched or self.failed)

    @classmethod
    def merged(cls, reports: Iterable[LoadReport]) -> LoadReport:
        """One report of several ranks' (each name once)."""
        reports = list(reports)
        joined = cls(reports[0].checkpoint)
        for attr in ("missing", "unexpected", "mismatched", "failed", "initialized"):
            values = {value for report in reports for value in getattr(report, attr)}
            setattr(joined, attr, sorted(values))
        return joined

    def _findings(self) -> list[str]:
        found = []
        if self.missing:
            found.append(
                f"{_count(self.missing, 'tensor')} of the model not in it: {_few(self.missing)}"
            )
        if self.unexpected:
            found.append(
                f"{_count(self.unexpected, 'tensor')} in it that the model does not have: "
                f"{_few(self.unexpected)}"
            )
        if self.mismatched:
            shapes = [
                f"{n} {tuple(c)} in it, {tuple(m)} in the model" for n, c, m in self.mismatched
            ]
            found.append(f"{_count(shapes, 'tensor')} of another shape: {_few(shapes, 3, '; ')}")
        if self.failed:
            found.append(
                f"{_count(self.failed, 'conversion')} that failed: {_few(self.failed, 2, '; ')}"
            )
        return found

    def error(self) -> WeightsError:
        another = len(self.missing) > 1 and len(self.unexpected) > 1
        hint = (
            " (so many on both sides: is it the checkpoint of another model or configuration?)"
            if another
            else ""
        )
        return WeightsError(
            f"weights={self.checkpoint} does not fill the model{hint}:\n"
            + "\n".join(f"- {line}" for line in self._findings())
            + "\nRemedy: pass the checkpoint of this model and configuration (its config.json "
            "builds the model: AutoConfig.from_pretrained(DIR)), or strict=False to initialize "
            "the tensors it lacks, skip those of another shape and ignore the others (a warning "
            "lists them)",
            self,
        )

    def warning(self) -> str:
        return (
            f"weights={self.checkpoint} (strict=False) did not fill the model: "
            + "; ".join(self._findings())
            + f". Initialized instead: {_few(self.initialized, 6)}"
        )


def _count(names: list, what: str) -> str:
    return f"{len(names)} {what}{'s' if len(names) != 1 else ''}"


def _few(names: list[str], shown: int = 4, sep: str = ", ") -> str:
    more = f"{sep}... ({len(names) - shown} more)" if len(names) > shown else ""
    return sep.join(str(n) for n in names[:shown]) + more
