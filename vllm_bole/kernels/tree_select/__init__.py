"""The device beam's kernels: the top children of each query (``top_children.py``, with its torch twin), a level's
beam advance (``triton_beam.py``; twin ``spec_decode/device_beam.DeviceBeam.advance_reference``) and the
per-request quota selection in one launch (``triton_select.py``; twin ``reference.py``)."""
