"""Compatibility: the capture hook's old place, for SGLang launch lines written before it moved.

``--forward-hooks`` specs written by eagle3d before 0.2 name
``"hook_factory": "eagle3d.sglang_hook:make_hook"``; SGLang imports that inside its worker
processes. This module keeps them working. New specs (``eagle3d sglang-args``) name
:data:`eagle3d.remote.sglang_hook.FACTORY`.
"""

from __future__ import annotations

from eagle3d.remote.sglang_hook import make_hook

__all__ = ["make_hook"]
