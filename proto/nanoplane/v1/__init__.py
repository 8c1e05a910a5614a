"""nanoplane.v1: the Generation service (`generation.proto`); regenerate with `python proto/generate.py`."""
