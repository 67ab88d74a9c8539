"""The version of ring-tuner, which every cache row and recorded call carries."""

__version__ = "0.1.0"
