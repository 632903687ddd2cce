import sys

from ddserve.cli import main

sys.exit(main())
