"""The OCI prestart hook front door: `prestart` (the hook itself), `config` (/etc/gpuhook/config.toml), `plan`
(cached inventory × request → what one container gets), `log` (one best-effort line per start)."""
