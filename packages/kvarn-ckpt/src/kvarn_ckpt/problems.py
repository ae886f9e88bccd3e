"""Problems found in a checkpoint, and the errors raised when they must stop the caller.

Every check in this package reports into a :class:`ProblemList` instead of raising at the
first finding, so that ``kvarn-ckpt inspect`` can show everything wrong with a checkpoint in
one run. Callers that must fail closed (the vLLM hook, ``annotate``) turn the errors into a
:class:`CheckpointError` with :meth:`ProblemList.raise_if_errors`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "CheckpointError",
    "KVFormatError",
    "Problem",
    "ProblemList",
    "SafetensorsHeaderError",
    "Severity",
]

Severity = Literal["error", "warning", "info"]
_SEVERITY_ORDER: dict[Severity, int] = {"error": 0, "warning": 1, "info": 2}


@dataclass(frozen=True, slots=True)
class Problem:
    """One finding.

    ``code`` is a stable, dotted identifier tests and scripts can match on (for example
    ``exl3.missing_tensor``); ``where`` names the file or tensor concerned when there is one.
    """

    severity: Severity
    code: str
    message: str
    where: str | None = None

    def __str__(self) -> str:
        loc = f" [{self.where}]" if self.where else ""
        return f"{self.severity}: {self.code}: {self.message}{loc}"

    def as_dict(self) -> dict[str, str | None]:
        return {
            "severity": self.severity,
            "code": self.code,
            "message": self.message,
            "where": self.where,
        }


class CheckpointError(ValueError):
    """A checkpoint that cannot be used as asked. ``problems`` holds every error found."""

    def __init__(self, message: str, problems: Iterable[Problem] = ()) -> None:
        super().__init__(message)
        self.problems: tuple[Problem, ...] = tuple(problems)


class KVFormatError(CheckpointError):
    """The KV cache format cannot be resolved safely (conflict, bad declaration, bad geometry)."""


class SafetensorsHeaderError(CheckpointError):
    """A safetensors file whose header is truncated, oversized or malformed."""


class ProblemList:
    """An ordered list of problems with a cap per code.

    A checkpoint with hundreds of thousands of EXL3 tensors can produce as many findings of
    one kind (a whole shard missing); the first ``cap_per_code`` of each code are kept and the
    rest are only counted, so reports stay readable while the totals stay exact.
    """

    def __init__(self, cap_per_code: int = 25) -> None:
        self._items: list[Problem] = []
        self._counts: Counter[tuple[Severity, str]] = Counter()
        self._cap = cap_per_code

    def add(self, severity: Severity, code: str, message: str, where: str | None = None) -> None:
        key = (severity, code)
        self._counts[key] += 1
        if self._counts[key] <= self._cap:
            self._items.append(Problem(severity, code, message, where))

    def error(self, code: str, message: str, where: str | None = None) -> None:
        self.add("error", code, message, where)

    def warning(self, code: str, message: str, where: str | None = None) -> None:
        self.add("warning", code, message, where)

    def info(self, code: str, message: str, where: str | None = None) -> None:
        self.add("info", code, message, where)

    def extend(self, problems: Iterable[Problem]) -> None:
        for p in problems:
            self.add(p.severity, p.code, p.message, p.where)

    def __iter__(self) -> Iterator[Problem]:
        return iter(self.items())

    def __len__(self) -> int:
        return sum(self._counts.values())

    def items(self) -> list[Problem]:
        """Kept problems, errors first, plus one summary line per code that overflowed."""
        out = list(self._items)
        for (severity, code), n in self._counts.items():
            if n > self._cap:
                out.append(Problem(severity, code, f"... and {n - self._cap} more {code} problems"))
        return sorted(out, key=lambda p: _SEVERITY_ORDER[p.severity])

    def count(self, severity: Severity | None = None, code: str | None = None) -> int:
        return sum(
            n
            for (s, c), n in self._counts.items()
            if (severity is None or s == severity) and (code is None or c == code)
        )

    @property
    def has_errors(self) -> bool:
        return self.count("error") > 0

    def codes(self, severity: Severity | None = None) -> set[str]:
        return {c for (s, c) in self._counts if severity is None or s == severity}

    def raise_if_errors(self, what: str, exc: type[CheckpointError] = CheckpointError) -> None:
        """Raise ``exc`` listing every kept error, if there is at least one."""
        errors = [p for p in self.items() if p.severity == "error"]
        if errors:
            lines = "\n".join(f"  - {p}" for p in errors)
            raise exc(f"{what}: {self.count('error')} error(s):\n{lines}", errors)
