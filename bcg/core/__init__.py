"""The capture machinery: breakpoints, segments, bridges, pools, plans, executors, and what every
capture in the process shares. Nothing here imports the layers above it (staged, keyed, the graph)."""
