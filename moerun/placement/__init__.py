"""Placement: what the machine offers and where each tensor goes.

`devices` (inventory), `bandwidth` (measured, cached), `planner` (pure: spec + inventory + budgets -> Plan).
"""
