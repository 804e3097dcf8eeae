"""One module per CLI command; kvtrace.cli loads them lazily."""
