"""The controller's room: the controller, its helpers and the ports they see it through.

It imports the wire (sockets, the job store, controller.json) and the policy (the rules); the rank's
client never imports it, it is handed ``Controller`` as a factory.
"""
from .controller import Controller, run_standalone

__all__ = ["Controller", "run_standalone"]
