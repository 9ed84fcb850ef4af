"""The rank runtime: what one rank of the job does for fault tolerance, in rooms with one direction.

    session  ->  fault_loop  ->  recovery  ->  state  ->  processor

``session``: the trainers' entry (their hooks: attach, step marks, ``survive``, close) and the wiring
of the replica optimizer. ``fault_loop``: a fault's way through the rank, top to bottom: raised,
reported, the controller's orders waited for and served, training resumed. ``recovery``: what the rank
does for each order (``recovery.handlers``), straight on the engine's calls (``RecoveryTools``: what
the orders use of them). ``state``: the rank's HA state, what a recovery uses of it. ``processor``:
the thread that reports to the controller and takes its orders (of the control plane, it imports the
wire only). The stop the fault loop and the recovery work with is ``comm.stop``'s, below this
package, handed in. tests/test_package_direction.py checks the direction.
"""
