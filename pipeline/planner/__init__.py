"""Optional tools a run does not import: the scale planner (`loongsage plan`: a simpy simulation of a run
through the real window code, plan.py) and the profile reader (`loongsage profile`, spans.py)."""
