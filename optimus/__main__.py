import sys

from optimus.cli import main

sys.exit(main())
