"""The node agent (``agent.py``): one per node and attempt of a multi-node run; see its
docstring."""
