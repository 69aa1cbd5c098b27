"""Private: the portable state formats, their codecs, limits and errors."""
