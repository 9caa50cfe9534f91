"""CDI: Inventory -> spec (per-device edits + common edits), qualified names, versions, validation, spec dirs,
the datacenter kinds, and the spec writer (yamlout). Nothing here mutates a container: the spec's container hook
is inject/containerhooks.py, reached through cli/entry.py or cli/cdi.py.
"""
