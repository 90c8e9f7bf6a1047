import sys

from zero.tools.cli import main

sys.exit(main())
