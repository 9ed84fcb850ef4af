"""The policy: the control plane's rules, as data and pure functions.

The state table, the round runner the strategies' playbooks are played by (control/strategies),
the fault ledger, the restart budget, the diagnosis, stragglers, the rank table's failure detection, the quorum and standby rules. No sockets,
no threads, no files; nothing else of control/ is imported here, so all of it is tested in
milliseconds against fakes.
"""
