"""Keyed breakpoints: a breakpoint's work captured once per key, and stitched executables."""
