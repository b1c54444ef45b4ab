"""Staged breakpoints: live metadata written into static buffers, the breakpoint captured inline."""
