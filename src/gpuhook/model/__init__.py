"""The pure model: inventory types, the container contract, request, selection, requirements, edits, reports.

No syscalls, no file writes, no discovery: everything here is a function of its arguments.
"""
