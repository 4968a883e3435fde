import sys

from tvmpipe.cli import main

sys.exit(main())
