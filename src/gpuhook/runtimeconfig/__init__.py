"""`gpuhook runtime configure`: turn CDI or the prestart hook on in a container runtime's own config file.

Edits are made in place (TOML through tomlkit, so comments survive; JSON with key order kept), planned in full
before anything is written, backed up to `<file>.gpuhook.bak` and written atomically. The click command is
cli/runtime.py.
"""
