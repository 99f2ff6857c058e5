"""What the folder holds: the `ptops` commands: parse, call, print (`app.py` is the entry point; one
module per command group). May import (of ptops): everything.
"""
