"""nanoplane: the command line, and what both planes share."""
