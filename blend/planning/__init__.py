"""Planning: the transfer-budget planner (`kvblend plan`), the live cost models, and the
load-or-compute split of one request.
"""
