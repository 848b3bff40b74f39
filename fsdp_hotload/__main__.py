"""``python -m fsdp_hotload ...``: the ``hotload`` command, where the script is not on PATH."""
import sys

from .cli import main

sys.exit(main())
