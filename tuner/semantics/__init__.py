"""What an attention call means: its features (`spec`), the masking rule written once (`masks`), the
layouts of a sequence over a ring, the dense float64 reference, and a problem with its cache key
(`problem`). Imports `support` only."""
