"""CDI: Inventory -> spec (per-device edits + common edits), qualified names, versions, validation, spec dirs.

Kept import-free on purpose: `gpuhook cdi-hook` (run by the runtime for every container start) imports this
package, and must not pay for YAML or jsonschema.
"""
