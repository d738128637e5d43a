"""A rank that `caffeplus train -gpu 0,1` started: python -m caffeplus.parallel RUNDIR RANK."""
import sys

from caffeplus.parallel.launcher import main

sys.exit(main())
