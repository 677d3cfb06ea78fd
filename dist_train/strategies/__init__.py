"""One module per strategy family; each registers itself with a `FAMILY` (see registry.py)."""
