"""The contract eagle3d and eagle3-top speak: events, journal codec, reducer, socket framing,
paths. Pure and small: no torch, no textual, no sglang."""
