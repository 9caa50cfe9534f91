"""`gpuhook-runtime`, the OCI runtime shim for runtimes without CDI or a hooks directory (runtime.py)."""
