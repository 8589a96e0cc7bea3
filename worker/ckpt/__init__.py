"""Checkpoints of the training state: one manager the loop calls, and what it is made of.

The package itself and `naming` (the on-disk layout) and `files` (scanning, marking, retention)
import no torch: the supervisor and faults/ read checkpoints through them.
"""
