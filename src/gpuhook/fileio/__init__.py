"""Host file primitives every layer may use: atomic writes that never replace what is not ours, file watching."""
