"""The supervisor's care of the nodes themselves: scratch sweeps, the memory tier's directory,
the run and checkpoint dirs' ownership, and the pre-launch node check (the program run on each
node and its judge). May import `contracts` and the layers below (`log` ... `launch`)."""
