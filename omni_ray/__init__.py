"""omni-ray: Ray-native serving for omni speech models."""

__version__ = "0.1.0"
