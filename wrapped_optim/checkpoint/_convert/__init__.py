"""Carrying optimizer state between runtimes: readers and writers over one canonical form."""
