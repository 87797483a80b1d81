#!/usr/bin/env python3
"""Peak RSS of writing speculators' index (``eagle3d.tools.exporters.speculators_index``)
for ROWS rows of TOKENS tokens each, the rows streamed as the export's manifest gives them.

    .venv/bin/python bench/speculators_index.py ROWS [TOKENS=2048]
"""

from __future__ import annotations

import contextlib
import os
import resource
import sys
import tempfile
from array import array
from collections.abc import Iterator
from typing import IO


def main() -> int:
    from eagle3d.tools import exporters

    rows = int(sys.argv[1])
    tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 2048
    ids = array("q", range(tokens)).tobytes()
    mask = array("q", [1] * tokens).tobytes()
    with tempfile.TemporaryDirectory() as d:

        class Files:
            @contextlib.contextmanager
            def open(self, name: str) -> Iterator[IO[bytes]]:
                with open(os.path.join(d, name), "wb") as f:
                    yield f

        exporters.speculators_index(Files(), (exporters.Row(k, ids, mask) for k in range(rows)))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"{rows} rows of {tokens} tokens: peak RSS {peak:.0f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
