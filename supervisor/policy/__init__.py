"""Pure decisions over observed facts: what an exit means, whether a rank is hung or stalled
and the limits that say so, whether and when to relaunch, which node to blame, which ranks
straggle, how often to checkpoint, who may read the job's files, what a continued job may
change. Nothing here touches a process, a socket or the clock. May import `contracts`,
`supervisor.log` and `supervisor.settings`."""
