"""The greedy tree walk in one launch (``triton_walk.py``); its torch twin is ``spec_decode/device_walk.py``."""
