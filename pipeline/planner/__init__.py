"""The scale planner: a simpy simulation of one run through the real window code (see pipeline/plan.py)."""
