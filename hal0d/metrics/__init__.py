"""Metrics: what hal0d remembers about the requests it served -- live gauges, Prometheus, and the
SQLite request history. Nothing here sits on the stream's way: writers hand data off and return."""
