"""The device beam's kernels: the top children of each query (``top_children.py``, with its torch twin), a level's
beam advance (``triton_beam.py``) and the per-request quota selection in one launch (``triton_select.py``), with
their torch twins (``reference.py``)."""
