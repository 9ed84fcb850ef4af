"""The rank's room: the processor thread every rank runs, its client of the controller.

It imports the wire only; the controller a rank hosts (rank 0's, a standby) is made by the factory
it is handed (``Processor(controller_factory=...)``), never imported.
"""
