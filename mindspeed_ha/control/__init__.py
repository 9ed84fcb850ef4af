"""The control plane, in four rooms with one direction between them:

    rank -> wire <- controller -> policy

``wire`` carries messages and finds the controller; ``policy`` holds the rules (pure); ``controller``
decides, through its helpers; ``rank`` is every rank's client. The launcher uses only ``wire``.
tests/test_control_layout.py checks the direction.
"""
