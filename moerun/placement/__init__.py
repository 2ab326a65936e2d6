"""Placement: what the machine offers (memory, measured bandwidths) and, later, where each tensor goes.

Pure planning code plus small, cached hardware measurements (`bandwidth.py`); see DESIGN.md, "The cost model".
"""
