"""eagle3d: crash-safe EAGLE-3 hidden-state extraction daemon."""

__version__ = "0.1.0"
