"""What the supervisor writes for people and reports to read back: the events file and the
console. The lowest layer: imports only the standard library, `contracts` and third-party
libraries."""
