"""The rank side of recovery: the handlers of the controller's orders, in-place repair, the dump."""
