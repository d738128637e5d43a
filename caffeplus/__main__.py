import sys

from caffeplus.cli import main

sys.exit(main())
