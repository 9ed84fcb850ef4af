"""The wire: what travels between processes and how they find each other.

The message protocol, CurveZMQ keys and roles, the controller's socket (router) and a client's link
to it, the job store (discovery), the progress board an agent reads, where a process runs (hosts), and
where the active controller is announced (controller.json, a client's candidate list). The rank, the
launcher and the controller import it; it imports none of them.
"""
