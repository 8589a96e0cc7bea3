"""The contracts between the supervisor, the ranks and the files they share.

Environment names, the heartbeat and control messages with their signing, directory locks, the
layouts of the checkpoint dir, the memory tier's scratch and the stack files, exit codes, and the
config file's table rules. Standard library only: the worker, the fault engine and the supervisor
all import it, and it imports none of them.
"""
