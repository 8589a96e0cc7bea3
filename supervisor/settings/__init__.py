"""The job as configured: the TOML config (its tables, checks and dump), the worker's
torch-free spec loaded by name (its flag check and shrink plan), and the fault spec through
`faults`. May import `contracts`, `faults` and `supervisor.log`."""
