"""SLO autoscaling of the worker roles: the pure decisions, Serve's app-level policy, the
binding and the router's membership watch.
"""
