"""The command line: `run`, `validate`, `status`, `tail`, `report`, `experiment`, their
pre-flight checks, continuing a job, and their output. The top layer: may import everything in
`supervisor`."""
