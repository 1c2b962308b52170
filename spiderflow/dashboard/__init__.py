"""The read-only web dashboard (see :mod:`spiderflow.dashboard.server`)."""
