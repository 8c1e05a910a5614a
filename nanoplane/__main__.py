"""`python -m nanoplane`: the nanoplane command."""

import sys

from nanoplane.cli import main

sys.exit(main())
