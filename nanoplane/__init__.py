"""Code shared by both planes and by the command line."""
