"""Watching the ranks while they run: the heartbeat socket, the rank table built from its
messages, the learned limits, node relays, the ranks' step times (stragglers), the checkpoint
costs rank 0 reports ("auto" intervals), the control channel's socket, pid watches and stack
collection. May import `contracts` and the layers below (`log`, `settings`, `policy`)."""
