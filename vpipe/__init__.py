"""vpipe: virtualized activation memory and live layer placement for pipeline-parallel PyTorch."""

__version__ = "0.1.0"
