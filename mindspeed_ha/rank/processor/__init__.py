"""The rank's processor: the thread every rank runs, its client of the controller (the rank runtime's
lowest room: the rank's state and its recovery's orders are above it).

Of the control plane it imports the wire only, and no torch; the controller a rank hosts (rank 0's,
a standby) is made by the factory it is handed (``Processor(controller_factory=...)``), never
imported. tests/test_control_layout.py checks it.
"""
