"""Applying container edits to a live container: the only code that mutates a container."""
