"""The classic data-parallel mistakes as components, for docs/debugging.md."""
