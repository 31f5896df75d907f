"""deepr's version, on the ground floor so that io.py can write it into every sidecar."""

__version__ = "0.1.0"
