"""``python -m detcomm.launch`` is ``detcomm-launch``."""

import sys

from .cli import main

sys.exit(main())
