"""Execution: a sequence and its schedule entry, the flat batch of one pass, and the runner that executes it
(eagerly or as a CUDA-graph replay) and hands back one result per scheduled sequence."""
