"""Producers turn token ids into dumps of hidden states. See :mod:`.base` for the seam."""
