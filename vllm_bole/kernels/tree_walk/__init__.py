"""The greedy tree walk in one launch (``triton_walk.py``) and its torch twin (``reference.py``); the runner calls
both through ``spec_decode/device_walk.py``."""
