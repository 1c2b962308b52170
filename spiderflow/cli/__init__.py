"""The ``spiderflow`` command line."""
