"""ptops: keep long TorchTitan and TRL training runs alive and honest."""

__version__ = "0.1.0"
