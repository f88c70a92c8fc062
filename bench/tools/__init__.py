"""Stand-alone measurement tools (`python -m bench.tools.NAME`), outside the bench's runs."""
