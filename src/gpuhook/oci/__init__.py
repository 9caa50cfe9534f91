"""Reading what an OCI runtime hands a hook: the state on stdin and the bundle's config.json."""
