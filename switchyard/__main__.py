import sys

from switchyard.cli import main

sys.exit(main())
