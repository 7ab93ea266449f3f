import sys

from deltaflash.cli import main

sys.exit(main())
