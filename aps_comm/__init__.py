"""aps-comm: low-precision gradient communication for PyTorch DDP."""

__version__ = "0.1.0"
