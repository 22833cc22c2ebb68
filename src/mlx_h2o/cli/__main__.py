# `python -m mlx_h2o.cli`, as before the package split (guarded: tests import every module of mlx_h2o)
import sys

from . import main

if __name__ == "__main__":
    sys.exit(main())
