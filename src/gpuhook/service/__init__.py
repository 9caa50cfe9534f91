"""`gpuhook service`: the resident process behind the native hook entry.

A runtime starts the hook for every container; a fresh Python per start costs ~25 ms before any work. The
service pays that once: it imports the hook's modules and loads the config and inventory at start, then forks a
child per request that runs exactly what the in-process hook runs (hook/prestart.handle). `protocol.py` is the
wire format, `server.py` the socket and the accept loop.
"""
