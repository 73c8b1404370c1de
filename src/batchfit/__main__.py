import sys

from batchfit.cli import main

sys.exit(main())
