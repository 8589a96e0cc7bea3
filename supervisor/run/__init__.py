"""The run loop: the job (its attempts, node pool, scratch and signals), one attempt's life
(standby, launching, running, ending), the standby keeper, graceful stop, stragglers, the "auto"
checkpoint intervals and the fault engine's hooks. May import `contracts`, `faults` and every
layer below."""
