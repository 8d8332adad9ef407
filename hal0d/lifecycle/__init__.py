"""Slots and their lifecycle: admission, the state table, processes, probes, groups."""
