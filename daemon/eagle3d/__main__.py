import sys

from eagle3d.cli import main

sys.exit(main())
