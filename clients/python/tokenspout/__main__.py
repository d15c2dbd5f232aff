import sys

from tokenspout.cli import main

sys.exit(main())
