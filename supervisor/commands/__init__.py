"""The command line: `run`, `validate`, `status`, `tail`, `report`, `experiment`, their
pre-flight checks and their output. The top layer: may import everything in `supervisor`."""
