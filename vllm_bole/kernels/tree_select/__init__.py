"""The device beam's per-request quota selection in one launch (``triton_select.py``); its torch twin is
``spec_decode/device_beam.quota_mask`` + ``queued_selection``."""
