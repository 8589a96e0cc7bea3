"""Starting and ending the ranks: the job resolved against its environment (nodes, world),
the launcher kinds behind a registry (`mpiexec`, `srun`, `local`), and the process tree's
teardown. The only place launcher kinds are compared. May import `contracts`, `faults` and the
layers below (`log`, `settings`, `policy`)."""
