"""Federated algorithms, one module per method; each module's docstring cites its paper."""
