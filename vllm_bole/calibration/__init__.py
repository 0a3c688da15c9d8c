"""Calibration of Bole's per-step node budget: ``vllm-bole calibrate`` measures T_ver(N) against T_dec per batch
size and KV length and writes the table that ``budget: "auto"`` reads.

``table``: the JSON schema, merging and lookup; ``drafter``: the fixed-shape tree drafter; ``sweep``: the timing
sweep on an in-process engine; ``__main__``: the command line.
"""
