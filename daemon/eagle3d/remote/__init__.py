"""Code that runs in other processes: the Hugging Face worker, the SGLang capture hook (inside
SGLang's scheduler processes), and what they share with the daemon (the dump contract's writer,
the storage formats, fault injection, thread names).

These modules may import only the standard library, torch, transformers, safetensors,
msgspec, :mod:`eagle3proto`'s framing (``codec``, ``wire``) and one another: never the
daemon (``tests/test_boundaries.py`` enforces it). The daemon imports from here, never the
other way round.
"""
