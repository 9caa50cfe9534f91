"""`gpuhook doctor`: why a container gets a GPU or not, and what on this host is in the way.

Five sections, each a list of findings: the host (driver, NVML, device nodes, ModifyDeviceFiles), the hook
service (does it answer where the entry looks), every installed runtime's configuration (hook, CDI, shim), every CDI
spec on disk (loads? current?), and, for one container (a bundle or an environment), the request → selection →
requirements → edits chain told step by step. Every step calls the function the hook, the CDI generator or the
shim calls; nothing here decides anything on its own.
A problem carries the one command (or, where there is none, the one action) that fixes it.
"""

from __future__ import annotations

from gpuhook.doctor.model import Finding, Report

__all__ = ["Finding", "Report"]
