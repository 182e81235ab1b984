import sys

from paratron.cli import main

sys.exit(main())
