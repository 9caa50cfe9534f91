"""Findings and the report they make up (plain data: rendered as text or JSON by doctor.cli)."""

from __future__ import annotations

from typing import Any

from gpuhook.model.record import Record, as_dict, field

OK, INFO, WARN, PROBLEM = "ok", "info", "warn", "problem"
SECTIONS = ("host", "service", "runtimes", "cdi", "container")  # in the order the text report prints them


class Finding(Record):
    """One observation. `fix`: the one command (or action) that fixes a problem or warning; `detail`: extra lines."""

    section: str
    status: str
    message: str
    fix: str = ""
    detail: tuple[str, ...] = ()


class Report(Record, frozen=False):
    findings: list[Finding] = field(default_factory=list)
    container: dict[str, Any] | None = None  # the explained request, for --json

    def add(self, findings: list[Finding]) -> None:
        self.findings.extend(findings)

    def count(self, status: str) -> int:
        return sum(f.status == status for f in self.findings)

    @property
    def ok(self) -> bool:
        return self.count(PROBLEM) == 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "problems": self.count(PROBLEM),
            "warnings": self.count(WARN),
            "findings": [{**as_dict(f), "detail": list(f.detail)} for f in self.findings],
            "container": self.container,
        }
