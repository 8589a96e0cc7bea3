"""Starting and ending the ranks: the job resolved against its environment (`resolve`: nodes,
world, program, flavor), its hosts (`hosts`), the launcher kinds (`kinds`: `mpiexec`, `srun`,
`local`) behind a registry (`registry`), the plan they build (`plan`, `hydra_lines`), and the
process tree started, watched and torn down (`processes`). The only place launcher kinds are
compared. May import `contracts`, `faults` and the layers below (`log`, `settings`,
`policy`)."""
