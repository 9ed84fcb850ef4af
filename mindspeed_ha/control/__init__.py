"""The control plane, in four rooms with one direction between them:

    wire <- controller -> strategies -> policy

``wire`` carries messages and finds the controller; ``policy`` holds the rules (pure): the one state
machine, the round runner, the ledger, the rank table; ``strategies`` holds each strategy in a file of
its own (its switch, its faults, its playbook) and the registry; ``controller`` decides, and plays
the chosen strategy, through its helpers. Every rank's client of it is the rank's processor (``rank.processor``),
which uses only ``wire``, as the launcher does. tests/test_control_layout.py checks the direction.
"""
