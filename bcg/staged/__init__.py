"""Staged breakpoints: live metadata written into staging buffers, the breakpoint captured inline."""
